-- The change log of what the API caches per tenant (issue 39): a row per change to a tenant's API keys, allow
-- lists or webhook secret, written by triggers in the changing transaction and stamped with its transaction id. A
-- process's caches (src/tenants/tenant_cache.ts) ask it every few seconds which tenants changed since the snapshot
-- of their last look, and confirm every other entry without reading it again: at 20,000 tenants the bulk re-reads
-- of every entry were a visible share of the API's CPU. A tenant of '*' (no tenant's name) stands for every tenant:
-- a TRUNCATE.
CREATE TABLE IF NOT EXISTS tenant_changes (
  xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
  tenant text NOT NULL
);
CREATE INDEX IF NOT EXISTS tenant_changes_xid ON tenant_changes (xid);

-- The relay's retention records, each pass, the oldest transaction still running (its snapshot's xmin), and deletes
-- the log's rows below the xmin it recorded at least an hour before: every such transaction had ended an hour ago,
-- so every look of the last hour sees it (a cache that has not looked for 30 minutes reads everything again). A
-- row's own time would not do: a transaction that began two hours ago may commit now.
CREATE TABLE IF NOT EXISTS tenant_change_horizons (
  at timestamptz PRIMARY KEY,
  oldest_running xid8 NOT NULL
);

-- TG_ARGV[0]: the column naming the tenant in the changed table.
CREATE OR REPLACE FUNCTION note_tenant_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP IN ('UPDATE', 'DELETE') THEN
    INSERT INTO tenant_changes (tenant) VALUES (to_jsonb(OLD) ->> TG_ARGV[0]);
  END IF;
  IF TG_OP IN ('UPDATE', 'INSERT') AND (TG_OP = 'INSERT' OR (to_jsonb(NEW) ->> TG_ARGV[0]) IS DISTINCT FROM (to_jsonb(OLD) ->> TG_ARGV[0])) THEN
    INSERT INTO tenant_changes (tenant) VALUES (to_jsonb(NEW) ->> TG_ARGV[0]);
  END IF;
  RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS api_keys_changes ON api_keys;
CREATE TRIGGER api_keys_changes AFTER INSERT OR UPDATE OR DELETE ON api_keys
  FOR EACH ROW EXECUTE FUNCTION note_tenant_change('tenant');
DROP TRIGGER IF EXISTS tenant_mail_domains_changes ON tenant_mail_domains;
CREATE TRIGGER tenant_mail_domains_changes AFTER INSERT OR UPDATE OR DELETE ON tenant_mail_domains
  FOR EACH ROW EXECUTE FUNCTION note_tenant_change('tenant');
DROP TRIGGER IF EXISTS tenant_webhook_hosts_changes ON tenant_webhook_hosts;
CREATE TRIGGER tenant_webhook_hosts_changes AFTER INSERT OR UPDATE OR DELETE ON tenant_webhook_hosts
  FOR EACH ROW EXECUTE FUNCTION note_tenant_change('tenant');
-- Of a tenant's own row, the caches read only whether it has a webhook secret.
DROP TRIGGER IF EXISTS tenants_changes ON tenants;
CREATE TRIGGER tenants_changes AFTER INSERT OR DELETE OR UPDATE OF webhook_secret, name ON tenants
  FOR EACH ROW EXECUTE FUNCTION note_tenant_change('name');

CREATE OR REPLACE FUNCTION note_every_tenant_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO tenant_changes (tenant) VALUES ('*');
  RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS api_keys_truncated ON api_keys;
CREATE TRIGGER api_keys_truncated AFTER TRUNCATE ON api_keys
  FOR EACH STATEMENT EXECUTE FUNCTION note_every_tenant_changed();
DROP TRIGGER IF EXISTS tenant_mail_domains_truncated ON tenant_mail_domains;
CREATE TRIGGER tenant_mail_domains_truncated AFTER TRUNCATE ON tenant_mail_domains
  FOR EACH STATEMENT EXECUTE FUNCTION note_every_tenant_changed();
DROP TRIGGER IF EXISTS tenant_webhook_hosts_truncated ON tenant_webhook_hosts;
CREATE TRIGGER tenant_webhook_hosts_truncated AFTER TRUNCATE ON tenant_webhook_hosts
  FOR EACH STATEMENT EXECUTE FUNCTION note_every_tenant_changed();
DROP TRIGGER IF EXISTS tenants_truncated ON tenants;
CREATE TRIGGER tenants_truncated AFTER TRUNCATE ON tenants
  FOR EACH STATEMENT EXECUTE FUNCTION note_every_tenant_changed();
