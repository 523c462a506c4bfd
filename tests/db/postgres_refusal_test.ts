/** Start-up names what is wrong with Postgres: a missing database is not a Postgres that is down (issue 37). */
import assert from "node:assert/strict";
import { connectPostgres, DependencyDown } from "../../src/clients.ts";
import { freePort } from "../_support.ts";

Deno.test("a Postgres that answers without the database says to create it, not to start Postgres", async () => {
  const url = "postgres://postgres@127.0.0.1:5432/oncely_no_such_database";
  await assert.rejects(connectPostgres(url), (error: Error) => {
    assert.ok(error instanceof DependencyDown);
    assert.match(error.message, /answers, but its database "oncely_no_such_database" does not exist/);
    assert.match(error.message, /createdb oncely_no_such_database/);
    assert.doesNotMatch(error.message, /docker compose/);
    return true;
  });
});

Deno.test("a Postgres that does not answer says how to start it", async () => {
  const url = `postgres://postgres@127.0.0.1:${await freePort()}/oncely`;
  await assert.rejects(connectPostgres(url), /does not answer: .*Start it with `docker compose up -d postgres`/);
});
