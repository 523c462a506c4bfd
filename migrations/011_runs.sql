-- Runs of tasks. Every job is a run: a summary job is a run of the built-in
-- `summarize` task (version 1), which is what the column defaults say, so the
-- rows written before tasks existed need no rewrite (a constant default is
-- stored once, not per row).
ALTER TABLE job_outcomes
  ADD COLUMN task text NOT NULL DEFAULT 'summarize',
  ADD COLUMN version integer NOT NULL DEFAULT 1;
ALTER TABLE model_attempts
  ADD COLUMN task text NOT NULL DEFAULT 'summarize',
  ADD COLUMN version integer NOT NULL DEFAULT 1;

-- A done run of a task other than summarize: its input and output (the
-- parsed JSON value with an output schema, else the text as a JSON string)
-- and the model that answered. A summary keeps its `summaries` row instead.
CREATE TABLE run_results (
  run_id uuid PRIMARY KEY,
  tenant text NOT NULL,
  input jsonb NOT NULL,
  output jsonb NOT NULL,
  model text,
  cached boolean NOT NULL DEFAULT false,
  created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX run_results_created_at ON run_results (created_at);

-- One row per finished run, summaries included, as an operator counts them:
-- how it ended (job_outcomes), and for a done run its output and model.
CREATE VIEW runs AS
SELECT o.job_id AS run_id,
       o.tenant,
       o.task,
       o.version,
       o.outcome AS status,
       COALESCE(r.output, to_jsonb(s.summary)) AS output,
       r.model,
       COALESCE(r.cached, false) AS cached,
       o.decided_at AS finished_at
FROM job_outcomes o
LEFT JOIN run_results r ON r.run_id = o.job_id
LEFT JOIN summaries s ON s.job_id = o.job_id;
