-- A run's tokens as its commit knew them (the successful delivery's calls), beside its result: the
-- OpenAI-compatible door answers a completion's `usage` at once from here, where `model_attempts` is written in
-- batches after the commit (up to 200 ms later). NULL for rows committed before this column, and for a cached
-- result (no call).
ALTER TABLE run_results ADD COLUMN IF NOT EXISTS prompt_tokens integer;
ALTER TABLE run_results ADD COLUMN IF NOT EXISTS completion_tokens integer;
