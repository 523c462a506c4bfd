-- Batch lines hold their worst case against the tenant's budgets (issue 43): a line's hold is taken in the
-- tenant's budget hash (field B:<run_id>) before the run is recorded into a batch, and released or charged
-- when its line is settled. Its amount is recorded here with the line, so a budget hash lost in Redis is
-- rebuilt with the holds of the lines still in flight (those not settled and not yet charged: no
-- model_attempts row). NULL: collected without a hold (no budget then, or before this migration), charged at
-- commit as before.
ALTER TABLE batch_runs ADD COLUMN IF NOT EXISTS held_tokens bigint;
ALTER TABLE batch_runs ADD COLUMN IF NOT EXISTS held_nanos bigint;
-- The rebuild reads a tenant's held lines in flight.
CREATE INDEX IF NOT EXISTS batch_runs_held ON batch_runs (tenant) WHERE settled IS NULL AND held_tokens IS NOT NULL;
