-- A tenant's spending limits (`deno task tenant budget NAME ...`): USD and
-- tokens, per UTC day and per calendar month (UTC). NULL = no limit. The
-- workers enforce them in Redis (a reservation before every model call,
-- settled at the reported usage); this is where they are set and kept.
ALTER TABLE tenants
  ADD COLUMN budget_usd_day numeric CONSTRAINT tenants_budget_usd_day CHECK (budget_usd_day >= 0),
  ADD COLUMN budget_usd_month numeric CONSTRAINT tenants_budget_usd_month CHECK (budget_usd_month >= 0),
  ADD COLUMN budget_tokens_day bigint CONSTRAINT tenants_budget_tokens_day CHECK (budget_tokens_day >= 0),
  ADD COLUMN budget_tokens_month bigint CONSTRAINT tenants_budget_tokens_month CHECK (budget_tokens_month >= 0);
