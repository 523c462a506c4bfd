/**
 * The console's task pages read columns, and only the definitions they
 * show, bounded in bytes (each definition may be hundreds of KB), over a
 * real Postgres.
 */
import assert from "node:assert/strict";
import { DEFINITION_BYTES_SHOWN, taskPage, tasksPage } from "../../src/console/task_pages.ts";
import type { PageDeps } from "../../src/console/pages.ts";
import { createTestDatabase } from "../_support.ts";
import { smallDefinition } from "../support/task_definitions.ts";

Deno.test("a task's page shows the newest definitions within 1 MiB, and every version's size", async () => {
  const db = await createTestDatabase();
  // The task pages read Postgres alone.
  const deps = { sql: db.sql } as unknown as PageDeps;
  const view = { csrf: "csrf" };
  try {
    // Six versions of about 300 KB (as a release before the 256 KiB bound could store them).
    for (let v = 1; v <= 6; v++) {
      const definition = { ...smallDefinition(v), system: "s".repeat(300_000) };
      await db.sql`INSERT INTO tasks (tenant, name, version, definition)
        VALUES ('acme', 'big', ${v}, ${db.sql.json(definition as never)})`;
    }
    const body = await (await taskPage(deps, view, "acme", "big")).text();
    const shown = [...body.matchAll(/<h2 id="v(\d+)">/g)].map((m) => Number(m[1]));
    assert.deepEqual(shown, [6, 5, 4], `at most ${DEFINITION_BYTES_SHOWN} bytes of definitions`);
    assert.match(body, /The 3 newest definitions are shown/);
    const sizes = [...body.matchAll(/<td>(\d{6})<\/td>/g)].map((m) => Number(m[1]));
    assert.equal(sizes.length, 6, "every version's size");
    assert.ok(sizes.every((n) => n > 300_000 && n < 301_000), String(sizes));
    // One version alone, however large.
    const one = await (await taskPage(deps, view, "acme", "big", "1")).text();
    assert.deepEqual([...one.matchAll(/<h2 id="v(\d+)">/g)].map((m) => Number(m[1])), [1]);

    const list = await (await tasksPage(deps, view)).text();
    assert.match(list, /1 task\(s\)/);
    assert.match(list, /<td>6<\/td>/, "its versions");
    assert.ok(list.length < 20_000, "no definition on the list");
  } finally {
    await db.close();
  }
});
