-- Task definitions: every version of every tenant's task. A version never
-- changes; a changed definition is the next version. `definition` holds the
-- normalised definition (defaults filled in), so that a PUT of the same body
-- finds it equal (jsonb equality ignores key order and spacing).
CREATE TABLE IF NOT EXISTS tasks (
  tenant text NOT NULL,
  name text NOT NULL,
  version integer NOT NULL CHECK (version >= 1),
  definition jsonb NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant, name, version)
);
