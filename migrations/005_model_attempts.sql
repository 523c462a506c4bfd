-- One row per model call: what it cost (tokens), how long it took, how it
-- ended. Written in batches by the workers, off the job's commit path; read
-- by `deno task usage`, GET /v1/summaries/{id} (attempts and tokens) and the
-- console. Rows older than MODEL_ATTEMPTS_RETENTION_S are deleted.
CREATE TABLE model_attempts (
  id bigserial PRIMARY KEY,
  job_id uuid NOT NULL,
  tenant text NOT NULL,
  delivery integer NOT NULL,
  attempt integer NOT NULL,
  started_at timestamptz NOT NULL,
  duration_ms double precision NOT NULL,
  -- ok, retry, give_up, deadline, or paused (absorbed by the provider's flow control)
  outcome text NOT NULL,
  status integer,
  prompt_tokens integer,
  completion_tokens integer,
  provider_request_id text,
  model text NOT NULL,
  error text
);
CREATE INDEX model_attempts_job ON model_attempts (job_id);
CREATE INDEX model_attempts_started ON model_attempts (started_at, tenant);
