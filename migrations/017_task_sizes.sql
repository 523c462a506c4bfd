-- Task definitions bounded by bytes (issue 37). Lists of tasks, the console,
-- `tasks list`, the per-tenant quota and start-up read columns, never a
-- definition (each up to 256 KiB now, about 730 KB before).
--
-- Per version: `definition_bytes`, the UTF-8 length of its definition as
-- compact canonical JSON (what the API measures and writes; a row inserted
-- without it, before this migration or by an older release during an
-- upgrade, gets the length of Postgres's text of the jsonb, a few percent
-- more); `digest`, SHA-256 hex of that canonical JSON, which a PUT compares
-- before it checks anything (NULL for rows written before: the PUT then
-- compares the jsonb values); `model` and `has_output_schema`, copied out of
-- the definition by the trigger below.
ALTER TABLE tasks
  ADD COLUMN IF NOT EXISTS definition_bytes integer,
  ADD COLUMN IF NOT EXISTS digest text,
  ADD COLUMN IF NOT EXISTS model jsonb,
  ADD COLUMN IF NOT EXISTS has_output_schema boolean;

UPDATE tasks SET
  definition_bytes = octet_length(definition::text),
  model = definition->'model',
  has_output_schema = definition ? 'output_schema';

ALTER TABLE tasks
  ALTER COLUMN definition_bytes SET NOT NULL,
  ALTER COLUMN has_output_schema SET NOT NULL;

CREATE OR REPLACE FUNCTION tasks_fill_columns() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.definition_bytes := coalesce(NEW.definition_bytes, octet_length(NEW.definition::text));
  NEW.model := NEW.definition->'model';
  NEW.has_output_schema := NEW.definition ? 'output_schema';
  RETURN NEW;
END $$;

CREATE TRIGGER tasks_fill_columns BEFORE INSERT ON tasks
  FOR EACH ROW EXECUTE FUNCTION tasks_fill_columns();

-- One row per task: its latest version's columns, how many versions it has
-- and their bytes in all. Kept by the trigger below on every insert into
-- `tasks`, whoever inserts (an older release during an upgrade too), so a
-- tenant's tasks, their count and their bytes are read from at most 1,000
-- rows, never from every version.
CREATE TABLE task_heads (
  tenant text NOT NULL,
  name text NOT NULL,
  version integer NOT NULL,
  created_at timestamptz NOT NULL,
  definition_bytes integer NOT NULL,
  digest text,
  model jsonb,
  has_output_schema boolean NOT NULL,
  versions integer NOT NULL,
  total_bytes bigint NOT NULL,
  first_created_at timestamptz NOT NULL,
  PRIMARY KEY (tenant, name)
);

INSERT INTO task_heads (tenant, name, version, created_at, definition_bytes, digest, model, has_output_schema,
                        versions, total_bytes, first_created_at)
SELECT DISTINCT ON (tenant, name) tenant, name, version, created_at, definition_bytes, digest, model,
       has_output_schema, count(*) OVER w, sum(definition_bytes) OVER w, min(created_at) OVER w
FROM tasks
WINDOW w AS (PARTITION BY tenant, name)
ORDER BY tenant, name, version DESC;

CREATE OR REPLACE FUNCTION tasks_keep_head() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  -- Every SET expression reads the row as it was (h), so each CASE compares with the old latest version.
  INSERT INTO task_heads AS h (tenant, name, version, created_at, definition_bytes, digest, model,
                               has_output_schema, versions, total_bytes, first_created_at)
  VALUES (NEW.tenant, NEW.name, NEW.version, NEW.created_at, NEW.definition_bytes, NEW.digest, NEW.model,
          NEW.has_output_schema, 1, NEW.definition_bytes, NEW.created_at)
  ON CONFLICT (tenant, name) DO UPDATE SET
    version = greatest(h.version, EXCLUDED.version),
    created_at = CASE WHEN EXCLUDED.version > h.version THEN EXCLUDED.created_at ELSE h.created_at END,
    definition_bytes = CASE WHEN EXCLUDED.version > h.version
                            THEN EXCLUDED.definition_bytes ELSE h.definition_bytes END,
    digest = CASE WHEN EXCLUDED.version > h.version THEN EXCLUDED.digest ELSE h.digest END,
    model = CASE WHEN EXCLUDED.version > h.version THEN EXCLUDED.model ELSE h.model END,
    has_output_schema = CASE WHEN EXCLUDED.version > h.version
                             THEN EXCLUDED.has_output_schema ELSE h.has_output_schema END,
    versions = h.versions + 1,
    total_bytes = h.total_bytes + EXCLUDED.total_bytes,
    first_created_at = least(h.first_created_at, EXCLUDED.first_created_at);
  RETURN NULL;
END $$;

CREATE TRIGGER tasks_keep_head AFTER INSERT ON tasks
  FOR EACH ROW EXECUTE FUNCTION tasks_keep_head();

-- Each tenant's bucket of task PUTs (a PUT that would store a new version
-- takes one token; they come back at TASK_PUTS_PER_MINUTE, up to
-- TASK_PUT_BURST): `tokens` as of `at`.
CREATE TABLE task_put_tokens (
  tenant text PRIMARY KEY,
  tokens double precision NOT NULL,
  at timestamptz NOT NULL
);
