-- Hosts a tenant's webhooks may go to. A tenant with no rows may send to any
-- host (that passes the address checks); `deno task tenant allow-webhook-host
-- NAME HOST` restricts it.
CREATE TABLE tenant_webhook_hosts (
  tenant text NOT NULL REFERENCES tenants (name),
  host text NOT NULL,
  PRIMARY KEY (tenant, host)
);
