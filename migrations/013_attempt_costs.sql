-- What each model call cost, at the prices in force when it was recorded
-- (LLM_PRICES, or LLM_PRICE_IN/OUT_PER_MTOK): the reported usage at the
-- model's price; for a call that timed out after it was sent (no usage
-- reported), the reservation it was charged against the tenant's budget.
-- NULL when the model has no price. `deployment` names which deployment of
-- the model served the call (the model's own name until deployments exist).
ALTER TABLE model_attempts
  ADD COLUMN cost_usd numeric,
  ADD COLUMN deployment text;

-- When the job was accepted (its stream entry's time), so that the console
-- can chart latency from acceptance to outcome. NULL for rows written before.
ALTER TABLE job_outcomes ADD COLUMN accepted_at timestamptz;
