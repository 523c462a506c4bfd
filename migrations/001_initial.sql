-- Tenants and their API keys. A key is "onc_<id>_<secret>"; only a SHA-256 of
-- the secret is stored, and it is compared in constant time.
CREATE TABLE tenants (
  name text PRIMARY KEY,
  created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
  id text PRIMARY KEY,
  tenant text NOT NULL REFERENCES tenants (name),
  secret_sha256 bytea NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now(),
  revoked_at timestamptz
);
CREATE INDEX api_keys_tenant ON api_keys (tenant);

-- One row per finished job: the primary key is the exactly-once guard.
CREATE TABLE summaries (
  job_id uuid PRIMARY KEY,
  tenant text NOT NULL,
  summary text NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
);

-- Side effects to perform, written in the same transaction as the summary.
CREATE TABLE outbox (
  id bigserial PRIMARY KEY,
  topic text NOT NULL,
  dedupe_key text NOT NULL UNIQUE,
  payload jsonb NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now(),
  attempts integer NOT NULL DEFAULT 0,
  last_error text,
  next_attempt_at timestamptz NOT NULL DEFAULT now(),
  locked_until timestamptz,
  sent_at timestamptz,
  failed_at timestamptz
);
CREATE INDEX outbox_due ON outbox (next_attempt_at, id) WHERE sent_at IS NULL AND failed_at IS NULL;
CREATE INDEX outbox_sent ON outbox (sent_at) WHERE sent_at IS NOT NULL;

-- Wake relays the moment a row commits (NOTIFY is delivered on commit).
CREATE FUNCTION oncely_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('oncely_outbox', '');
  RETURN NULL;
END;
$$;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
  FOR EACH STATEMENT EXECUTE FUNCTION oncely_outbox_notify();
