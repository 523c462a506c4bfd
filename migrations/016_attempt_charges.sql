-- The tokens each model call was charged against its tenant's budgets: the
-- usage the provider reported, or, for a call that may have run without
-- reporting any (a timeout after it was sent, a stop while in flight), the
-- reservation it was charged. A budget rebuilt from this record (its hash lost
-- in Redis) counts those calls at their charge, not as 0 tokens. NULL for rows
-- written before (counted at their reported tokens).
ALTER TABLE model_attempts ADD COLUMN IF NOT EXISTS charged_tokens bigint;
