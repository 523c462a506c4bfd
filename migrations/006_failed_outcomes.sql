-- A dead-lettered job is decided too: 'failed', with the reason. The worker
-- inserts it before it moves the message to the dead letters, on the same
-- primary key the commit and a cancel race on, so a job is done, cancelled
-- or failed, never first one and then another: a delivery still running
-- elsewhere when its job is dead-lettered cannot commit afterwards, and a job
-- already done or cancelled is acknowledged instead of dead-lettered.
-- Replaying the dead letter deletes the 'failed' row first (only that kind).
ALTER TABLE job_outcomes DROP CONSTRAINT job_outcomes_outcome_check;
ALTER TABLE job_outcomes ADD CONSTRAINT job_outcomes_outcome_check
  CHECK (outcome IN ('done', 'cancelled', 'failed'));
ALTER TABLE job_outcomes ADD COLUMN error text;
