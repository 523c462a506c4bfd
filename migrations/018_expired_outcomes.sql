-- A run whose model call had not started by its expiry (`expires_in`, issue
-- 41) is decided 'expired', on the same primary key as the commit, a cancel
-- and a dead letter: whichever is decided first stands, so a late worker
-- cannot run an expired run and a cancel against one changes nothing.
-- `expires_at` is when it expired (NULL for every other outcome), which the
-- console shows.
ALTER TABLE job_outcomes DROP CONSTRAINT job_outcomes_outcome_check;
ALTER TABLE job_outcomes ADD CONSTRAINT job_outcomes_outcome_check
  CHECK (outcome IN ('done', 'cancelled', 'failed', 'expired'));
ALTER TABLE job_outcomes ADD COLUMN IF NOT EXISTS expires_at timestamptz;
