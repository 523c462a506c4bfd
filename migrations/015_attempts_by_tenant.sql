-- GET /v1/usage and the console's usage page read one tenant's calls over a
-- window: by tenant first, so that a tenant's report does not scan every
-- other tenant's calls in the window.
CREATE INDEX IF NOT EXISTS model_attempts_tenant_started ON model_attempts (tenant, started_at);
