-- A run answered from the result cache: no model call, the output of an
-- earlier done run (`source_run_id`) of the same tenant, task version, model
-- and input. The tokens and cost are the source's: what the hit saved.
CREATE TABLE cache_hits (
  run_id uuid PRIMARY KEY,
  tenant text NOT NULL,
  task text NOT NULL,
  version integer NOT NULL,
  model text,
  source_run_id uuid NOT NULL,
  saved_prompt_tokens integer NOT NULL DEFAULT 0,
  saved_completion_tokens integer NOT NULL DEFAULT 0,
  saved_usd numeric,
  created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX cache_hits_tenant_created ON cache_hits (tenant, created_at);
CREATE INDEX cache_hits_created ON cache_hits (created_at);

-- `cached` is true for a run answered from the cache, summaries included.
CREATE OR REPLACE VIEW runs AS
SELECT o.job_id AS run_id,
       o.tenant,
       o.task,
       o.version,
       o.outcome AS status,
       COALESCE(r.output, to_jsonb(s.summary)) AS output,
       COALESCE(r.model, h.model) AS model,
       (COALESCE(r.cached, false) OR h.run_id IS NOT NULL) AS cached,
       o.decided_at AS finished_at
FROM job_outcomes o
LEFT JOIN run_results r ON r.run_id = o.job_id
LEFT JOIN summaries s ON s.job_id = o.job_id
LEFT JOIN cache_hits h ON h.run_id = o.job_id;
