import assert from "node:assert/strict";
import { migrate, readMigrations } from "../../src/db/migrate.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createTestDatabase } from "../_support.ts";

Deno.test("migrate() creates the contract's tables and records each file once", async () => {
  const db = await createTestDatabase({ migrate: false });
  try {
    const migrations = await readMigrations();
    const applied = await migrate({ sql: db.sql, log: silentLogger }, migrations);
    assert.deepEqual(applied, migrations.map((m) => m.name));
    const tables = await db.sql<{ table_name: string }[]>`
      SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' ORDER BY table_name`;
    for (const t of ["api_keys", "oncely_migrations", "outbox", "summaries", "tenants"]) {
      assert.ok(tables.some((r) => r.table_name === t), `table ${t} exists`);
    }
    assert.deepEqual(await migrate({ sql: db.sql, log: silentLogger }, migrations), [], "second run applies nothing");
  } finally {
    await db.close();
  }
});

Deno.test("migrate() run from two connections at once applies each migration exactly once", async () => {
  const db = await createTestDatabase({ migrate: false });
  try {
    const migrations = await readMigrations();
    const postgres = (await import("postgres")).default;
    const other = postgres(db.url, { max: 1, onnotice: () => {} });
    try {
      const [a, b] = await Promise.all([
        migrate({ sql: db.sql, log: silentLogger }, migrations),
        migrate({ sql: other, log: silentLogger }, migrations),
      ]);
      assert.deepEqual([...a, ...b].sort(), migrations.map((m) => m.name).sort());
      const [row] = await db.sql<{ count: number }[]>`SELECT count(*)::int AS count FROM oncely_migrations`;
      assert.equal(row!.count, migrations.length);
    } finally {
      await other.end();
    }
  } finally {
    await db.close();
  }
});

Deno.test("migrate() refuses a migration whose file changed after it was applied", async () => {
  const db = await createTestDatabase();
  try {
    const migrations = await readMigrations();
    const changed = migrations.map((m, i) => (i === 0 ? { ...m, sql: m.sql + "\n-- edited" } : m));
    await assert.rejects(
      () => migrate({ sql: db.sql, log: silentLogger }, changed),
      /was changed after it was applied/,
    );
  } finally {
    await db.close();
  }
});
