-- Provider batches (issue 43). Runs with priority "batch" for a model whose
-- deployment is marked "batch": true are recorded here (their messages are
-- acknowledged only once recorded) and sent through the provider's Batch API.
-- A batch moves through its states one at a time, each recorded before the
-- next step's effect at the provider, so that a process killed anywhere
-- leaves a state the next one resumes from:
--   open       collecting runs (one open batch per deployment and model)
--   closed     no more runs (BATCH_MAX_RUNS, or BATCH_MAX_WAIT_S of collecting)
--   uploading  its lines are fixed (batch_runs.in_file): the intent to upload
--   uploaded   input_file_id recorded
--   creating   the intent to create the provider batch: a process resuming
--              here first searches the provider's batches for our id in
--              their metadata, and creates one only if none is found
--   submitted  provider_batch_id recorded; polled
--   ended      the provider's final status and file ids recorded
--   committed  every line committed, failed, or sent online
CREATE TABLE batches (
  id uuid PRIMARY KEY,
  deployment text NOT NULL,
  model text NOT NULL,
  state text NOT NULL DEFAULT 'open' CHECK (state IN
    ('open', 'closed', 'uploading', 'uploaded', 'creating', 'submitted', 'ended', 'committed')),
  runs integer NOT NULL DEFAULT 0,
  opened_at timestamptz NOT NULL DEFAULT now(),
  closed_at timestamptz,
  creating_at timestamptz,
  input_file_id text,
  provider_batch_id text,
  provider_status text,
  output_file_id text,
  error_file_id text,
  ended_at timestamptz,
  committed_at timestamptz,
  -- The process advancing it holds it until then (a step at a time).
  lease_until timestamptz,
  updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX batches_one_open ON batches (deployment, model) WHERE state = 'open';
CREATE INDEX batches_unfinished ON batches (state, opened_at) WHERE state <> 'committed';

-- A run recorded into a batch: once, whatever the deliveries (its primary key).
CREATE TABLE batch_runs (
  run_id uuid PRIMARY KEY,
  batch_id uuid NOT NULL REFERENCES batches (id),
  tenant text NOT NULL,
  -- The stream payload as intake accepted it: what its commit and its notification need.
  payload text NOT NULL,
  -- The Chat Completions request body of its line.
  request jsonb NOT NULL,
  accepted_ms double precision,
  -- NULL while its batch collects; at the upload intent, true if its line is in the file, false if it was left
  -- out (cancelled, or otherwise decided, before the upload).
  in_file boolean,
  -- NULL until its line was settled: committed (or found decided), failed, or sent to the online path.
  settled text CHECK (settled IN ('committed', 'failed', 'online', 'left_out')),
  recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX batch_runs_batch ON batch_runs (batch_id);

-- A model call made through a provider batch: its batch (NULL for an online call). One row per line, whatever
-- the reads of its output file (the unique index).
ALTER TABLE model_attempts ADD COLUMN IF NOT EXISTS batch_id uuid;
CREATE UNIQUE INDEX model_attempts_batch_line ON model_attempts (job_id, batch_id) WHERE batch_id IS NOT NULL;
