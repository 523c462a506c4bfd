/**
 * The console's Batches page (issue 43), signed in with the bearer header through the API's handler, over real
 * Postgres rows: the batches in flight and those committed in the last 24 h (the rows of `batches list`), newest
 * first, with the figures of the worker's gauges; what a provider wrote (its batch id, its status) escaped; a
 * console without a batch deployment says so.
 */
import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { createConsole } from "../../src/console/console.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { apiHandler } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

const TOKEN = "batch-pages-test-admin-token-0123456789";
const HOSTILE = "</script><img src=x onerror=alert(1)>";
const ESCAPED = "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;";
const HOUR = 3600_000;

/** The cells of each body row of the page's tables, tags stripped. */
function cellsOf(body: string): string[][] {
  return [...body.matchAll(/<tr>([\s\S]*?)<\/tr>/g)].map((tr) =>
    [...tr[1]!.matchAll(/<td>([\s\S]*?)<\/td>/g)].map((td) => td[1]!.replace(/<[^>]*>/g, "").trim())
  ).filter((cells) => cells.length > 0);
}

/** The text inside `<dd id="ID">`. */
function ddOf(body: string, id: string): string | undefined {
  return new RegExp(`<dd id="${id}">([\\s\\S]*?)</dd>`).exec(body)?.[1]?.trim();
}

/** A batch row as the submitter and the poller leave it, with `runs` runs of which `waiting` are not settled. */
async function plantBatch(
  sql: Sql,
  b: {
    id?: string;
    deployment?: string;
    model?: string;
    state: string;
    runs: number;
    waiting?: number;
    openedAt: Date;
    providerBatchId?: string;
    providerStatus?: string;
    endedAt?: Date;
    committedAt?: Date;
  },
): Promise<string> {
  const id = b.id ?? crypto.randomUUID();
  await sql`
    INSERT INTO batches (id, deployment, model, state, runs, opened_at, provider_batch_id, provider_status, ended_at,
      committed_at)
    VALUES (${id}::uuid, ${b.deployment ?? "east"}, ${b.model ?? "gpt-test"}, ${b.state}, ${b.runs}, ${b.openedAt},
      ${b.providerBatchId ?? null}, ${b.providerStatus ?? null}, ${b.endedAt ?? null}, ${b.committedAt ?? null})`;
  for (let i = 0; i < b.runs; i++) {
    await sql`
      INSERT INTO batch_runs (run_id, batch_id, tenant, payload, request, settled)
      VALUES (${crypto.randomUUID()}::uuid, ${id}::uuid, 'acme', '{}', '{}'::jsonb,
        ${i < (b.waiting ?? 0) ? null : "committed"})`;
  }
  return id;
}

Deno.test("the Batches page lists the batches in flight and those committed in the last 24 h, escaped", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const NOW = Date.now();
  const at = (msAgo: number) => new Date(NOW - msAgo);
  const handlerWith = async (batchDeployments?: string[]) =>
    apiHandler({ redis: r.redis, sql: db.sql, keys }, {
      authMode: "api-key",
      console: await createConsole({
        redis: r.redis,
        sql: db.sql,
        keys,
        log: silentLogger,
        token: TOKEN,
        maxBodyBytes: 1 << 20,
        auth: { turnMs: 10 },
        now: () => NOW,
        batchDeployments,
      }),
    });
  const get = async (handler: (req: Request) => Promise<Response>, path: string) => {
    const res = await handler(new Request(`http://api${path}`, { headers: { authorization: `Bearer ${TOKEN}` } }));
    return { status: res.status, body: await res.text() };
  };
  try {
    const handler = await handlerWith(["east"]);

    await t.step(
      "with no batch yet: the empty sentence, no figure, and the link in every page's navigation",
      async () => {
        const { status, body } = await get(handler, "/console/batches");
        assert.equal(status, 200);
        assert.match(body, /<h1>Batches<\/h1>/);
        assert.match(body, /No batches in flight or committed in the last 24 h\./);
        assert.match(body, /<p id="batch-deployments">Batch deployments: east\.<\/p>/);
        assert.equal(ddOf(body, "batches-in-flight"), "0");
        assert.equal(ddOf(body, "oldest-in-flight"), "none");
        for (const path of ["/console/batches", "/console/tasks", "/console/outbox"]) {
          assert.match((await get(handler, path)).body, /<a href="\/console\/batches">Batches<\/a>/, path);
        }
      },
    );

    const open = await plantBatch(db.sql, { state: "open", runs: 2, waiting: 2, openedAt: at(90_000) });
    const submitted = await plantBatch(db.sql, {
      deployment: "west",
      model: "gpt-other",
      state: "submitted",
      runs: 3,
      waiting: 3,
      openedAt: at(3 * HOUR),
      // What the provider answered, shown as data.
      providerBatchId: `batch_${HOSTILE}`,
      providerStatus: HOSTILE,
    });
    const committed = await plantBatch(db.sql, {
      state: "committed",
      runs: 4,
      openedAt: at(5 * HOUR),
      providerBatchId: "batch_abc",
      providerStatus: "completed",
      endedAt: at(1.5 * HOUR),
      committedAt: at(HOUR),
    });
    // Committed 30 h ago: past the page's 24 h.
    const old = await plantBatch(db.sql, {
      state: "committed",
      runs: 1,
      openedAt: at(40 * HOUR),
      endedAt: at(31 * HOUR),
      committedAt: at(30 * HOUR),
    });

    await t.step("each batch's row, newest first, with its age; the figures are the gauges'", async () => {
      const { status, body } = await get(handler, "/console/batches");
      assert.equal(status, 200);
      assert.deepEqual(cellsOf(body), [
        [open, "east", "gpt-test", "2", "open", "", "", at(90_000).toISOString(), "90.0 s", "", ""],
        [
          submitted,
          "west",
          "gpt-other",
          "3",
          "submitted",
          `batch_${ESCAPED}`,
          ESCAPED,
          at(3 * HOUR).toISOString(),
          "3.0 h",
          "",
          "",
        ],
        [
          committed,
          "east",
          "gpt-test",
          "4",
          "committed",
          "batch_abc",
          "completed",
          at(5 * HOUR).toISOString(),
          // Committed: how long it took.
          "4.0 h",
          at(1.5 * HOUR).toISOString(),
          at(HOUR).toISOString(),
        ],
      ]);
      assert.ok(!body.includes(old), "committed over 24 h ago: not listed");
      assert.equal(ddOf(body, "batches-in-flight"), "2");
      assert.equal(ddOf(body, "batch-runs-waiting"), "5");
      assert.equal(ddOf(body, "oldest-in-flight"), "3.0 h");
      // Nothing the provider wrote became markup: the only script tag is the console's own.
      assert.ok(!/<img|onerror=alert\(1\)>/.test(body.replaceAll(ESCAPED, "")));
      assert.equal(body.match(/<script/g)?.length, 1);
    });

    await t.step("without a batch deployment: the page says so, and still lists what Postgres holds", async () => {
      const { status, body } = await get(await handlerWith(), "/console/batches");
      assert.equal(status, 200);
      assert.match(body, /<p class="empty" id="no-batch-deployments">No deployment of <code>LLM_DEPLOYMENTS<\/code>/);
      assert.equal(cellsOf(body).length, 3);
    });

    await t.step("signed out: no page, a redirect to the sign-in form", async () => {
      const res = await handler(new Request("http://api/console/batches"));
      await res.body?.cancel();
      assert.equal(res.status, 303);
      assert.equal(res.headers.get("location"), "/console/login");
    });
  } finally {
    await r.close();
    await db.close();
  }
});
