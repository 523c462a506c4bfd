/**
 * What a tenant's task definitions may cost (issue 37), over the real API
 * handler, Postgres and Redis: a version's size, a tenant's stored bytes,
 * its rate of new versions, `GET /v1/tasks` a page at a time without
 * definitions, a PUT identical to the latest answered without a compile,
 * new definitions checked on a Worker (the serving thread stays free), a
 * bad name on PUT, and a run naming a version no row can hold.
 */
import assert from "node:assert/strict";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { taskVersion } from "../../src/jobs/task_store.ts";
import { checkDefinition, DEFINITION_LIMITS, TaskDefinition } from "../../src/tasks/definition.ts";
import { createDefinitionChecker, type DefinitionChecker } from "../../src/tasks/definition_checker.ts";
import { TASK_LIST } from "../../src/tasks/api.ts";
import { createTaskCache } from "../../src/tasks/task_cache.ts";
import { createClient } from "../../src/client/client.ts";
import { permissionFlags } from "../../src/permissions.ts";
import { parseConfig } from "../../src/config.ts";
import { apiHandler, jsonClient } from "../support/fixtures.ts";
import { heavyDefinition, smallDefinition } from "../support/task_definitions.ts";
import { thisThread, threadsCpuMs } from "../support/threads.ts";
import { createTestDatabase, createTestRedis, recordingLogger } from "../_support.ts";
import { createLogger, silentLogger } from "../../src/log/logger.ts";
import { migrate, readMigrations } from "../../src/db/migrate.ts";

const ROOT = decodeURIComponent(new URL("../..", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../../migrations/", import.meta.url).pathname);

/** A checker that counts the definitions it is asked to check. */
function countingChecker(inner: DefinitionChecker) {
  const counted = { checks: 0 };
  const checker: DefinitionChecker = {
    check(json, tenant) {
      counted.checks++;
      return inner.check(json, tenant);
    },
    pool: () => inner.pool(),
    close: () => inner.close(),
  };
  return { counted, checker };
}

/** The fields of a definition: none may be in a list of tasks. */
const DEFINITION_FIELDS = Object.keys(TaskDefinition.shape);

Deno.test("task definitions are bounded in bytes, in stored bytes and in PUTs a minute", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const inner = createDefinitionChecker();
  const { counted, checker } = countingChecker(inner);
  const log = recordingLogger();
  const logger = createLogger({ write: log.write, level: "debug" });
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix), log: logger }, {
    authMode: "api-key",
    definitions: checker,
    taskLimits: { maxTenantBytes: 4_000, putsPerMinute: 1, putBurst: 3 },
  });
  const stored = async (tenant: string) =>
    (await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM tasks WHERE tenant = ${tenant}`)[0]!.n;
  try {
    await t.step("a definition over 256 KiB of UTF-8 JSON is a 422 naming its size and the bound", async () => {
      const put = jsonClient(api, await createApiKey(db.sql, "big"));
      // Each field is within its own bound (100,000 characters), but 2-byte characters make 400 KB together.
      const body = { ...smallDefinition(), prompt: "é".repeat(99_000) + "{{input.body}}", system: "é".repeat(99_000) };
      const res = await put("PUT", "/v1/tasks/big", body);
      assert.equal(res.status, 422, JSON.stringify(res.body));
      assert.match(res.body.detail, /^The definition is 396\d{3} bytes of JSON .*the limit is 262144$/);
      assert.equal(res.body.errors[0].pointer, "");
      assert.equal(DEFINITION_LIMITS.maxBytes, 262_144);
      assert.equal(await stored("big"), 0);
      // Just under the bound is stored (by a handler with the default quota: 4,000 bytes would refuse it).
      const roomy = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
        authMode: "api-key",
        definitions: checker,
      });
      const under = await jsonClient(roomy, await createApiKey(db.sql, "big2"))("PUT", "/v1/tasks/big", {
        ...body,
        system: "é".repeat(30_000),
      });
      assert.equal(under.status, 201, JSON.stringify(under.body));
    });

    await t.step(
      "past the tenant's byte quota a new version is a 409 naming the bytes; nothing is stored",
      async () => {
        // A handler of its own: no rate to meet, the same quota.
        const unhurried = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
          authMode: "api-key",
          definitions: checker,
          taskLimits: { maxTenantBytes: 4_000, putsPerMinute: 60_000, putBurst: 1_000 },
        });
        const put = jsonClient(unhurried, await createApiKey(db.sql, "quota"));
        const body = (i: number) => ({ ...smallDefinition(i), system: "s".repeat(300) });
        // Twelve new tasks at once, each about 470 bytes: eight fit in 4,000 bytes, and the tenant's PUTs are
        // decided one at a time, so not one byte more is stored.
        const answers = await Promise.all(Array.from({ length: 12 }, (_, i) => put("PUT", `/v1/tasks/t${i}`, body(i))));
        const [{ each }] = await db.sql<[{ each: number }]>`
        SELECT max(definition_bytes)::int AS each FROM tasks WHERE tenant = 'quota'`;
        const fits = Math.floor(4_000 / each);
        assert.deepEqual(
          answers.map((a) => a.status).sort(),
          [...Array(fits).fill(201), ...Array(12 - fits).fill(409)],
          `${each} bytes each`,
        );
        const over = answers.find((a) => a.status === 409)!;
        assert.match(
          over.body.detail,
          /^This tenant's task versions take [\d,]+ bytes; this one's \d+ more would pass/,
        );
        assert.match(over.body.detail, /the 4,000 bytes one tenant may store$/);
        assert.equal(await stored("quota"), fits);
        const [{ total }] = await db.sql<[{ total: number }]>`
        SELECT sum(definition_bytes)::int AS total FROM tasks WHERE tenant = 'quota'`;
        assert.ok(total <= 4_000, `${total} bytes stored`);
        // A new version of a stored task is refused the same way; the same definition again still answers.
        const stored0 = answers.findIndex((a) => a.status === 201);
        assert.equal((await put("PUT", `/v1/tasks/t${stored0}`, body(100))).status, 409);
        assert.equal((await put("PUT", `/v1/tasks/t${stored0}`, body(stored0))).status, 200);
        const listed = await put("GET", "/v1/tasks");
        assert.deepEqual(listed.body.usage, { tasks: fits, max_tasks: 1_000, bytes: total, max_bytes: 4_000 });
      },
    );

    await t.step(
      "over the PUT rate a new version is a 429 with Retry-After; identical PUTs take no token",
      async () => {
        const key = await createApiKey(db.sql, "rate");
        const put = jsonClient(api, key);
        assert.equal((await put("PUT", "/v1/tasks/r0", smallDefinition(0))).status, 201);
        // The same definition again, however often, takes no token.
        for (let i = 0; i < 10; i++) assert.equal((await put("PUT", "/v1/tasks/r0", smallDefinition(0))).status, 200);
        const created = [];
        for (let i = 1; i < 3; i++) created.push((await put("PUT", `/v1/tasks/r${i}`, smallDefinition(i))).status);
        assert.deepEqual(created, [201, 201], "the rest of the burst of 3");
        const checksBefore = counted.checks;
        const refused = await put("PUT", "/v1/tasks/r3", smallDefinition(3));
        assert.equal(refused.status, 429, JSON.stringify(refused.body));
        const retryAfter = Number(refused.headers.get("retry-after"));
        assert.ok(retryAfter >= 55 && retryAfter <= 60, `Retry-After: ${retryAfter} (one a minute)`);
        assert.match(refused.body.detail, /1 new task versions a minute, 3 at once; try again in \d+ s/);
        assert.equal(counted.checks, checksBefore, "nothing was compiled for it");
        assert.equal(await stored("rate"), 3);
        // Over the rate every PUT waits, before its body is read: an identical one too.
        assert.equal((await put("PUT", "/v1/tasks/r0", smallDefinition(0))).status, 429);
        // Another tenant has a bucket of its own.
        const other = jsonClient(api, await createApiKey(db.sql, "other"));
        assert.equal((await other("PUT", "/v1/tasks/r3", smallDefinition(3))).status, 201);
        // The typed client waits a Retry-After out only up to its bound (here 1 s), then says when to come back.
        const client = createClient({
          baseUrl: "http://api",
          apiKey: key,
          maxRetryAfterS: 1,
          fetch: (u, init) => api(new Request(u, init)),
        });
        const error = await client.putTask("r3", smallDefinition(3) as never).catch((e) => e);
        assert.equal(error.status, 429);
        assert.ok(error.retryAfterS >= 55, String(error.retryAfterS));
      },
    );

    await t.step("a bad task name on PUT is a 422, not a 404", async () => {
      const put = jsonClient(api, await createApiKey(db.sql, "names"));
      for (const name of ["Upper", "9lives", "a".repeat(65), "with%20space"]) {
        const res = await put("PUT", `/v1/tasks/${name}`, smallDefinition());
        assert.equal(res.status, 422, name);
        assert.match(res.body.detail, /A task name is a lowercase letter/);
      }
      assert.equal((await put("GET", "/v1/tasks/Upper")).status, 404, "reading one is still a 404");
    });

    await t.step("a run naming version 2^31 or more is a 404 for that version, not a 500", async () => {
      const key = await createApiKey(db.sql, "versions");
      const call = jsonClient(api, key);
      assert.equal((await call("PUT", "/v1/tasks/ticket", smallDefinition())).status, 201);
      for (const version of [2 ** 31 - 1, 2 ** 31, 2 ** 40, Number.MAX_SAFE_INTEGER]) {
        const res = await call("POST", "/v1/tasks/ticket/runs", { input: { body: "hi" }, version }, {
          "idempotency-key": `version-${version}-0123456789`,
        });
        assert.equal(res.status, 404, `${version}: ${JSON.stringify(res.body)}`);
        assert.match(res.body.detail, new RegExp(`version ${version}`));
        assert.equal(await taskVersion(db.sql, "versions", "ticket", version), undefined);
        assert.equal(await createTaskCache(db.sql).get("versions", "ticket", version), undefined);
      }
      assert.equal((await call("GET", `/v1/tasks/ticket/versions/${2 ** 31}`)).status, 404);
      assert.ok(!log.lines.some((line) => line.level === "error"), JSON.stringify(log.lines.filter((l) => l.level)));
    });
  } finally {
    await inner.close();
    await r.close();
    await db.close();
  }
});

Deno.test("GET /v1/tasks pages through a tenant's tasks by name, without any definition", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, { authMode: "api-key" });
  try {
    const key = await createApiKey(db.sql, "many");
    const call = jsonClient(api, key);
    // 250 tasks (3 versions of the first), planted as the store writes them, and one task of another tenant.
    const definition = { ...heavyDefinition("stored"), max_output_tokens: 100 };
    await db.sql`
      INSERT INTO tasks (tenant, name, version, definition)
      SELECT 'many', 'task_' || lpad(i::text, 3, '0'), 1, ${db.sql.json(definition as never)}
      FROM generate_series(0, 249) AS i`;
    await db.sql`
      INSERT INTO tasks (tenant, name, version, definition)
      SELECT 'many', 'task_000', v, ${db.sql.json(smallDefinition() as never)} FROM generate_series(2, 3) AS v`;
    await db.sql`INSERT INTO tasks (tenant, name, version, definition)
      VALUES ('someone', 'hidden', 1, ${db.sql.json(smallDefinition() as never)})`;

    const first = await call("GET", "/v1/tasks");
    assert.equal(first.status, 200);
    assert.equal(first.body.tasks.length, 1 + TASK_LIST.defaultLimit, "summarize, then a page of 100");
    assert.deepEqual(first.body.tasks[0], {
      name: "summarize",
      version: 1,
      bytes: first.body.tasks[0].bytes,
      versions: 1,
      total_bytes: first.body.tasks[0].bytes,
      built_in: true,
    });
    assert.equal(first.body.next, "/v1/tasks?after=task_099&limit=100");
    const names: string[] = [];
    let page = first;
    for (;;) {
      for (const item of page.body.tasks) {
        for (const field of DEFINITION_FIELDS) assert.ok(!(field in item), `${item.name} has no ${field}`);
        if (!item.built_in) names.push(item.name);
      }
      if (page.body.next === null) break;
      page = await call("GET", page.body.next);
      assert.equal(page.status, 200);
    }
    assert.deepEqual(names, Array.from({ length: 250 }, (_, i) => `task_${String(i).padStart(3, "0")}`));
    const [head] = first.body.tasks.slice(1);
    assert.equal(head.name, "task_000");
    assert.equal(head.version, 3);
    assert.equal(head.versions, 3);
    assert.ok(head.total_bytes > 180_000 && head.bytes < 1_000, JSON.stringify(head));
    assert.ok(Date.parse(head.created_at) > 0);
    // 250 definitions of 190 KB are about 47 MB; their list is a few KB.
    assert.ok(JSON.stringify(first.body).length < 20_000, `${JSON.stringify(first.body).length} characters`);

    const all = await call("GET", `/v1/tasks?limit=${TASK_LIST.maxLimit}`);
    assert.equal(all.body.tasks.length, 251);
    assert.equal(all.body.next, null);
    const client = createClient({ baseUrl: "http://api", apiKey: key, fetch: (u, init) => api(new Request(u, init)) });
    assert.deepEqual((await client.listTasks()).map((t) => t.name), ["summarize", ...names], "the client follows next");
    for (const query of ["limit=0", "limit=1001", "limit=x", "after=Nope", "page=2", "limit=1&limit=2"]) {
      assert.equal((await call("GET", `/v1/tasks?${query}`)).status, 400, query);
    }
    assert.deepEqual(
      (await call("GET", "/v1/tasks?after=task_248&limit=5")).body.tasks.map((t: { name: string }) => t.name),
      [
        "task_249",
      ],
    );
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("a PUT identical to the latest version compiles nothing; a new one is checked on a Worker", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const inner = createDefinitionChecker();
  const { counted, checker } = countingChecker(inner);
  const slow = createDefinitionChecker({ deadlineMs: 1 });
  const limits = { putsPerMinute: 60_000, putBurst: 1_000 };
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
    authMode: "api-key",
    definitions: checker,
    taskLimits: limits,
  });
  // The same store, with a checker whose deadline no definition meets.
  const hurried = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
    authMode: "api-key",
    definitions: slow,
    taskLimits: limits,
  });
  try {
    const key = await createApiKey(db.sql, "acme");
    const put = jsonClient(api, key);
    await t.step("the first PUT is checked once; the same body again, reordered, is 200 without a check", async () => {
      assert.equal((await put("PUT", "/v1/tasks/heavy", heavyDefinition())).status, 201);
      assert.equal(counted.checks, 1);
      const reordered = Object.fromEntries(Object.entries(heavyDefinition()).reverse());
      for (let i = 0; i < 5; i++) {
        const again = await put("PUT", "/v1/tasks/heavy", reordered);
        assert.equal(again.status, 200);
        assert.equal(again.body.version, 1);
      }
      assert.equal(counted.checks, 1, "no compile for an identical PUT");
      // A version stored before digests were (digest NULL) is still found identical, as jsonb.
      await db.sql`UPDATE tasks SET digest = NULL WHERE tenant = 'acme'`;
      await db.sql`UPDATE task_heads SET digest = NULL WHERE tenant = 'acme'`;
      assert.equal((await put("PUT", "/v1/tasks/heavy", heavyDefinition())).status, 200);
      assert.equal(counted.checks, 1);
    });

    await t.step("a check over its deadline is a 422 that says so; an identical PUT still answers 200", async () => {
      const hurry = jsonClient(hurried, key);
      assert.equal((await hurry("PUT", "/v1/tasks/heavy", heavyDefinition())).status, 200);
      const changed = await hurry("PUT", "/v1/tasks/heavy", heavyDefinition(1));
      assert.equal(changed.status, 422, JSON.stringify(changed.body));
      assert.equal(changed.body.detail, "Checking the definition took longer than 1 ms; simplify its schemas");
      assert.equal((await put("GET", "/v1/tasks/heavy")).body.version, 1, "nothing stored");
    });

    await t.step("a refused definition is a 422 from the Worker, naming where", async () => {
      const res = await put("PUT", "/v1/tasks/bad", { ...smallDefinition(), prompt: "{{input.nobody}}" });
      assert.equal(res.status, 422);
      assert.equal(res.body.errors[0].pointer, "/prompt");
    });

    await t.step("heavy definitions are checked on the Worker's thread, not on this one", async () => {
      // CPU time, not wall-clock time, so that other processes on the machine do not change the figures.
      const tid = await thisThread();
      // What one check costs on this thread, warmed up: what each PUT would add to it without the Worker.
      const parsed = TaskDefinition.parse(heavyDefinition("calibrate"));
      checkDefinition(parsed);
      let before = (await threadsCpuMs()).get(tid)!;
      for (let i = 0; i < 5; i++) checkDefinition(parsed);
      const oneCheckMs = ((await threadsCpuMs()).get(tid)! - before) / 5;
      before = (await threadsCpuMs()).get(tid)!;
      for (let i = 0; i < 8; i++) {
        assert.equal((await put("PUT", "/v1/tasks/heavy", heavyDefinition(`v${i}`))).status, 201);
      }
      const spent = (await threadsCpuMs()).get(tid)! - before;
      assert.ok(
        spent < 8 * oneCheckMs / 2,
        `8 PUTs took ${spent} ms of this thread's CPU; one check in this thread takes ${oneCheckMs} ms`,
      );
      assert.equal(counted.checks, 1 + 8 + 1);
    });
  } finally {
    await inner.close();
    await slow.close();
    await r.close();
    await db.close();
  }
});

Deno.test("the task cache is bounded by bytes: the least recently used versions go past the budget", async () => {
  const db = await createTestDatabase();
  try {
    // Ten versions of about 30 KB each, in a cache of 100 KB: at most three are held.
    for (let v = 1; v <= 10; v++) {
      await db.sql`INSERT INTO tasks (tenant, name, version, definition)
        VALUES ('acme', 'big', ${v}, ${db.sql.json({ ...smallDefinition(v), system: "s".repeat(30_000) })})`;
    }
    const cache = createTaskCache(db.sql, { maxBytes: 100_000 });
    for (let v = 1; v <= 10; v++) assert.equal((await cache.get("acme", "big", v))?.version, v);
    const held = Array.from({ length: 10 }, (_, i) => i + 1).filter((v) => cache.peek("acme", "big", v));
    assert.deepEqual(held, [8, 9, 10]);
    // A hit makes a version the most recently used: it stays when the next one comes in.
    cache.peek("acme", "big", 8);
    await cache.get("acme", "big", 8);
    await cache.get("acme", "big", 1);
    assert.deepEqual(
      Array.from({ length: 10 }, (_, i) => i + 1).filter((v) => cache.peek("acme", "big", v)),
      [1, 8, 10],
    );
  } finally {
    await db.close();
  }
});

Deno.test("the api command's permission set lets its process check definitions in a child, and needs its run grant", async () => {
  const flags = permissionFlags("api", parseConfig({}), MIGRATIONS);
  const run = async (flags: string[], definition: unknown, isolation = "process") => {
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["run", ...flags, "tests/support/definition_probe.ts", JSON.stringify(definition), isolation],
      cwd: ROOT,
      stdout: "piped",
      stderr: "piped",
    }).output();
    return new TextDecoder().decode(out.stdout).trim();
  };
  assert.equal(await run(flags, smallDefinition()), "passed");
  assert.equal(
    await run(flags, { ...smallDefinition(), prompt: "{{input.x}}" }),
    "refused /prompt: {{input.x}} names no property the input schema declares",
  );
  // Without the run grant the child cannot start: the check fails instead of hanging.
  const withoutRun = await run(flags.filter((flag) => !flag.startsWith("--allow-run=")), smallDefinition());
  assert.match(withoutRun, /^failed: .*Requires run access/);
  // A compiled binary's set checks on a Worker: it reads the Worker's modules, and runs nothing.
  const binary = permissionFlags("api", parseConfig({}), MIGRATIONS, { binary: true });
  assert.ok(!binary.some((flag) => flag.startsWith("--allow-run")));
  assert.equal(await run(binary, smallDefinition(), "thread"), "passed");
  const withoutRead = await run(binary.filter((f) => !f.startsWith("--allow-read=")), smallDefinition(), "thread");
  assert.match(withoutRead, /^failed: .*Requires read access to ".*definition_worker\.ts"/);
});

Deno.test("migration 017 measures the versions stored before it and keeps task_heads on every insert", async () => {
  const db = await createTestDatabase({ migrate: false });
  try {
    const migrations = await readMigrations();
    const at = migrations.findIndex((m) => m.name.startsWith("017_"));
    await migrate({ sql: db.sql, log: silentLogger }, migrations.slice(0, at));
    // As a release before wrote them: no size, no digest.
    for (
      const [tenant, name, version, definition] of [
        ["acme", "a", 1, smallDefinition(1)],
        ["acme", "a", 2, { ...smallDefinition(2), model: ["m1", "m2"] }],
        ["acme", "b", 1, { ...smallDefinition(3), output_schema: { type: "object" } }],
        ["beta", "a", 1, smallDefinition(4)],
      ] as const
    ) {
      await db.sql`INSERT INTO tasks (tenant, name, version, definition)
        VALUES (${tenant}, ${name}, ${version}, ${db.sql.json(definition as never)})`;
    }
    await migrate({ sql: db.sql, log: silentLogger }, migrations.slice(at));
    const heads = await db.sql<
      { key: string; version: number; versions: number; model: unknown; out: boolean; exact: boolean }[]
    >`
      SELECT tenant || '/' || name AS key, version, versions, model, has_output_schema AS out,
        total_bytes = (SELECT sum(octet_length(definition::text)) FROM tasks t
                       WHERE t.tenant = h.tenant AND t.name = h.name) AS exact
      FROM task_heads h ORDER BY tenant, name`;
    assert.deepEqual(heads.map((h) => [h.key, h.version, h.versions, h.model, h.out]), [
      ["acme/a", 2, 2, ["m1", "m2"], false],
      ["acme/b", 1, 1, null, true],
      ["beta/a", 1, 1, null, false],
    ]);
    assert.ok(
      heads.every((h) => (h as unknown as { exact: boolean }).exact),
      "old versions' bytes as Postgres writes them",
    );
    // A version inserted afterwards, as an older release would (no size): measured by the trigger, counted.
    await db.sql`INSERT INTO tasks (tenant, name, version, definition)
      VALUES ('acme', 'a', 3, ${db.sql.json(smallDefinition(5) as never)})`;
    const [a] = await db.sql<{ version: number; versions: number; model: unknown }[]>`
      SELECT version, versions, model FROM task_heads WHERE tenant = 'acme' AND name = 'a'`;
    assert.deepEqual({ ...a }, { version: 3, versions: 3, model: null });
  } finally {
    await db.close();
  }
});
