/**
 * A DATABASE_URL whose first host is hung (it takes the connection and never answers, as a powered-off or
 * frozen server looks to a client that gets no refusal): postgres.js does not move to the next host after
 * CONNECT_TIMEOUT, so start-up probes every host and puts those that answer first.
 */
import assert from "node:assert/strict";
import { connectPostgres } from "../../src/clients.ts";
import { createTestDatabase } from "../_support.ts";

/** A TCP listener that takes connections and never says a word. */
function silentServer() {
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const held: Deno.Conn[] = [];
  const accepting = (async () => {
    for await (const conn of listener) held.push(conn);
  })().catch(() => {});
  return {
    port: (listener.addr as Deno.NetAddr).port,
    async close() {
      listener.close();
      for (const conn of held) conn.close();
      await accepting;
    },
  };
}

Deno.test("a hung first host of DATABASE_URL neither stops start-up nor fails the pool's connections", async () => {
  const db = await createTestDatabase();
  const silent = silentServer();
  const name = new URL(db.url).pathname;
  const url = `postgres://postgres@127.0.0.1:${silent.port},127.0.0.1:5432${name}?target_session_attrs=read-write`;
  try {
    // Start-up succeeds (before, its first query waited for the hung host until CONNECT_TIMEOUT and failed).
    const sql = await connectPostgres(url, { max: 4 });
    try {
      // Every pool connection (four at once) lands on the host that answers, at the first attempt.
      const rows = await Promise.all(
        [1, 2, 3, 4].map(() => sql<{ port: number }[]>`SELECT inet_server_port() AS port, pg_sleep(0.05)`),
      );
      assert.deepEqual(rows.map(([row]) => row!.port), [5432, 5432, 5432, 5432]);
    } finally {
      await sql.end({ timeout: 1 });
    }
  } finally {
    await silent.close();
    await db.close();
  }
});
