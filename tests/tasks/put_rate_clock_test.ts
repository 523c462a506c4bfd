/** A tenant's bucket of PUTs does not lock it out when Postgres's clock steps back (issue 37 review). */
import assert from "node:assert/strict";
import { putTokenWait, takePutToken } from "../../src/jobs/task_store.ts";
import { createTestDatabase } from "../_support.ts";

Deno.test("an empty bucket stamped in the future (the clock went back) counts as full, not as an hour's wait", async () => {
  const db = await createTestDatabase();
  const rate = { perMinute: 1, burst: 2 };
  try {
    assert.equal(await takePutToken(db.sql, "acme", rate), 0);
    assert.equal(await takePutToken(db.sql, "acme", rate), 0);
    assert.ok(await takePutToken(db.sql, "acme", rate) >= 1, "empty: a wait");
    // As after a failover to a primary whose clock is an hour behind the old one.
    await db.sql`UPDATE task_put_tokens SET at = clock_timestamp() + interval '1 hour' WHERE tenant = 'acme'`;
    assert.equal(await putTokenWait(db.sql, "acme", rate), 0);
    assert.equal(await takePutToken(db.sql, "acme", rate), 0);
    assert.equal(await takePutToken(db.sql, "acme", rate), 0);
    assert.ok(await takePutToken(db.sql, "acme", rate) >= 1, "a full bucket's worth, then paced from the new stamp");
  } finally {
    await db.close();
  }
});
