-- The change log of what the API caches per tenant (issue 39): a row per change to a tenant's API keys, allow
-- lists or webhook secret, written by triggers in the changing transaction and stamped with its transaction id. A
-- process's caches (src/tenants/tenant_cache.ts) ask it every few seconds which tenants changed since the snapshot
-- of their last look, and confirm every other entry without reading it again: at 20,000 tenants the bulk re-reads
-- of every entry were a visible share of the API's CPU. The relay's retention deletes rows after an hour.
CREATE TABLE IF NOT EXISTS tenant_changes (
  xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
  tenant text NOT NULL,
  at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS tenant_changes_xid ON tenant_changes (xid);
CREATE INDEX IF NOT EXISTS tenant_changes_at ON tenant_changes (at);

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
CREATE TRIGGER tenants_changes AFTER INSERT OR DELETE OR UPDATE OF webhook_secret ON tenants
  FOR EACH ROW EXECUTE FUNCTION note_tenant_change('name');
