-- A tenant's weight in the fair share of the model provider (`deno task
-- tenant set NAME --weight N`): while several tenants have work, each gets
-- estimated tokens in proportion to its weight. 1 for every tenant unless
-- set; the bounds keep one tenant from making the others' share vanish.
ALTER TABLE tenants ADD COLUMN weight integer NOT NULL DEFAULT 1
  CONSTRAINT tenants_weight_range CHECK (weight BETWEEN 1 AND 1000);
