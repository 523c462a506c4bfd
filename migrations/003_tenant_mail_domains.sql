-- Domains a tenant may send email to. A tenant with no rows may mail any
-- domain; `deno task tenant allow-domain NAME DOMAIN` restricts it.
CREATE TABLE tenant_mail_domains (
  tenant text NOT NULL REFERENCES tenants (name),
  domain text NOT NULL,
  PRIMARY KEY (tenant, domain)
);
