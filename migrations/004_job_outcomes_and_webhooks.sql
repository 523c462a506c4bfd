-- How each job ended, decided once: 'done' (its summary and outbox row were
-- committed) or 'cancelled' (neither ever will be). The commit and a cancel
-- both insert here; the primary key makes whichever commits first the only
-- outcome, even when they race (the loser's INSERT waits, then conflicts).
CREATE TABLE job_outcomes (
  job_id uuid PRIMARY KEY,
  tenant text NOT NULL,
  outcome text NOT NULL CHECK (outcome IN ('done', 'cancelled')),
  decided_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX job_outcomes_decided_at ON job_outcomes (decided_at);
-- Every job already done has its outcome (before the trigger: no wake-ups for old jobs).
INSERT INTO job_outcomes (job_id, tenant, outcome, decided_at)
SELECT job_id, tenant, 'done', created_at FROM summaries;

-- Wake API processes holding a `Prefer: wait` request the moment an outcome
-- commits (NOTIFY is delivered on commit; the payload is the job id).
CREATE FUNCTION oncely_job_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('oncely_jobs', job_id::text) FROM decided;
  RETURN NULL;
END;
$$;
CREATE TRIGGER job_outcomes_notify AFTER INSERT ON job_outcomes
  REFERENCING NEW TABLE AS decided
  FOR EACH STATEMENT EXECUTE FUNCTION oncely_job_notify();

-- Standard Webhooks signing secrets ("whsec_" + base64), one per tenant.
-- After a rotation the previous secret also signs for a day, so receivers
-- can switch over without dropping a delivery.
ALTER TABLE tenants ADD COLUMN webhook_secret text;
ALTER TABLE tenants ADD COLUMN webhook_secret_previous text;
ALTER TABLE tenants ADD COLUMN webhook_secret_rotated_at timestamptz;
