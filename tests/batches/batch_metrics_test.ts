/**
 * The batch metrics (issue 43): the gauges of the batches in flight read from real Postgres rows (written by the
 * store and by SQL as the submitter and the poller leave them), one query shared by a scrape's gauges; the lines
 * settled, counted by outcome where the submitter and the poller settle them, once each; the worker's wiring
 * (metrics only with a batch deployment); and every page clean under `promtool check metrics`.
 */
import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { Registry } from "prom-client";
import { createBatchPoller } from "../../src/batches/batch_poller.ts";
import { createBatchSubmitter } from "../../src/batches/batch_submitter.ts";
import { batchMetrics, IN_FLIGHT_STATES, LINE_OUTCOMES } from "../../src/batches/batch_metrics.ts";
import { recordBatchRun, settleBatchRun } from "../../src/batches/batch_store.ts";
import { parseConfig } from "../../src/config.ts";
import { createPrices } from "../../src/llm/prices.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { buildBatches } from "../../src/processes/_batches.ts";
import { createGroupCommitter } from "../../src/runs/commit.ts";
import { KEY_PREFIX, serviceKeys } from "../../src/runs/keys.ts";
import { deployment, deploymentsEnv } from "../support/deployments_env.ts";
import { promtool, promtoolMissing } from "../support/promtool.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";
import { batchPayload, batchWorld, Crash, DEPLOYMENT, MODEL } from "./_fixture.ts";

const missing = await promtoolMissing();

/** One sample of an exposition: its name, its labels, its value. */
interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

/** The samples of a Prometheus text exposition. */
function samples(text: string): Sample[] {
  const out: Sample[] = [];
  for (const line of text.split("\n")) {
    if (line === "" || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
    assert.ok(m, `an exposition line: ${line}`);
    const labels = Object.fromEntries(
      [...(m[2] ?? "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)].map((l) => [l[1], l[2]]),
    );
    out.push({ name: m[1]!, labels, value: Number(m[3]) });
  }
  return out;
}

/** The series of `name` as `labels -> value`, each key its label values joined by "/" in `keys`' order. */
function series(text: string, name: string, keys: string[]): Record<string, number> {
  return Object.fromEntries(
    samples(text).filter((s) => s.name === name).map((s) => [keys.map((k) => s.labels[k]).join("/"), s.value]),
  );
}

/** Checks an exposition with `promtool check metrics` (no finding at all), when promtool is installed. */
async function promtoolClean(text: string): Promise<void> {
  if (missing) return console.warn(`promtool check metrics skipped: ${missing}`);
  const { code, out } = await promtool(["check", "metrics"], text);
  assert.equal(code, 0, out);
  assert.equal(out.trim(), "", out);
}

/**
 * A batch as the submitter and the poller leave it: `state`, opened `ageS` ago, one run per entry of `lines` (its
 * `settled`, null for a line not settled yet). @returns its id.
 */
async function plantBatch(
  sql: Sql,
  { deployment, state, ageS, lines }: { deployment: string; state: string; ageS: number; lines: (string | null)[] },
): Promise<string> {
  const id = crypto.randomUUID();
  const committed = state === "committed";
  await sql`
    INSERT INTO batches (id, deployment, model, state, runs, opened_at, closed_at, committed_at)
    VALUES (${id}::uuid, ${deployment}, ${MODEL}, ${state}, ${lines.length}, now() - make_interval(secs => ${ageS}),
      now() - make_interval(secs => ${ageS}) + interval '5 minutes', ${committed ? sql`now()` : null})`;
  for (const settled of lines) {
    await sql`
      INSERT INTO batch_runs (run_id, batch_id, tenant, payload, request, in_file, settled)
      VALUES (${crypto.randomUUID()}::uuid, ${id}::uuid, 'acme', ${batchPayload("x")}, '{}'::jsonb,
        ${settled !== "left_out"}, ${settled})`;
  }
  return id;
}

Deno.test("the batch gauges: batches in flight by state and deployment, their runs not settled, the oldest's age", async () => {
  const db = await createTestDatabase();
  try {
    // An open batch of `east` with 2 runs, recorded by the store as intake records them.
    for (let i = 0; i < 2; i++) {
      await recordBatchRun(db.sql, {
        runId: crypto.randomUUID(),
        tenant: "acme",
        deployment: "east",
        model: MODEL,
        payload: batchPayload(`Document ${i}.`),
        request: { model: MODEL, messages: [] },
      }, { maxRuns: 5000 });
    }
    await plantBatch(db.sql, {
      deployment: "east",
      state: "submitted",
      ageS: 3 * 3600,
      lines: [null, null, null, null],
    });
    // Ended 25 h after it opened, and half settled: its 2 lines not settled still wait.
    await plantBatch(db.sql, {
      deployment: "east",
      state: "ended",
      ageS: 25 * 3600,
      lines: ["committed", "committed", "online", null, null],
    });
    await plantBatch(db.sql, { deployment: "west", state: "uploading", ageS: 600, lines: ["left_out", null, null] });
    // A deployment no longer configured, with a batch still in flight: it shows.
    await plantBatch(db.sql, { deployment: "gone", state: "creating", ageS: 3600, lines: [null] });
    // Committed batches, older than all: never counted, whatever their age.
    for (let i = 0; i < 3; i++) {
      await plantBatch(db.sql, {
        deployment: "east",
        state: "committed",
        ageS: 30 * 3600,
        lines: ["committed", "failed", "left_out"],
      });
    }

    const registry = new Registry();
    batchMetrics(registry, { sql: db.sql }, { deployments: ["east", "west", "north"], refreshMs: 0 });
    const text = await registry.metrics();
    const inFlight = series(text, "oncely_batches_in_flight", ["deployment", "state"]);
    const expected: Record<string, number> = {};
    for (const d of ["east", "west", "north"]) for (const s of IN_FLIGHT_STATES) expected[`${d}/${s}`] = 0;
    Object.assign(expected, {
      "east/open": 1,
      "east/submitted": 1,
      "east/ended": 1,
      "west/uploading": 1,
      "gone/creating": 1,
    });
    assert.deepEqual(inFlight, expected, "every configured deployment's 7 states, from 0; no committed batch");
    assert.deepEqual(series(text, "oncely_batch_runs_waiting", ["deployment"]), {
      east: 2 + 4 + 2,
      west: 2,
      north: 0,
      gone: 1,
    });
    const oldest = series(text, "oncely_batch_oldest_in_flight_seconds", ["deployment"]);
    assert.deepEqual(Object.keys(oldest).sort(), ["east", "gone", "north", "west"]);
    assert.ok(Math.abs(oldest.east! - 25 * 3600) < 60, `east: the ended batch, 25 h (${oldest.east})`);
    assert.ok(Math.abs(oldest.west! - 600) < 60, `west: 10 min (${oldest.west})`);
    assert.ok(Math.abs(oldest.gone! - 3600) < 60, `gone: 1 h (${oldest.gone})`);
    assert.equal(oldest.north, 0, "none in flight: 0");
    assert.deepEqual(
      series(text, "oncely_batch_lines_settled_total", ["deployment", "outcome"]),
      Object.fromEntries(
        ["east", "west", "north"].flatMap((d) => LINE_OUTCOMES.map((outcome) => [`${d}/${outcome}`, 0])),
      ),
      "each configured deployment's outcomes, from 0",
    );
    await promtoolClean(text);

    // Everything committed: the gauges fall to 0, each configured deployment's series still there.
    await db.sql`UPDATE batch_runs SET settled = 'committed' WHERE settled IS NULL`;
    await db.sql`UPDATE batches SET state = 'committed', committed_at = now()`;
    const after = await registry.metrics();
    const zero = series(after, "oncely_batches_in_flight", ["deployment", "state"]);
    assert.equal(Object.keys(zero).length, 3 * IN_FLIGHT_STATES.length, "the deployment gone is gone");
    assert.ok(Object.values(zero).every((v) => v === 0));
    assert.deepEqual(series(after, "oncely_batch_runs_waiting", ["deployment"]), { east: 0, west: 0, north: 0 });
    assert.deepEqual(series(after, "oncely_batch_oldest_in_flight_seconds", ["deployment"]), {
      east: 0,
      west: 0,
      north: 0,
    });
    await promtoolClean(after);
  } finally {
    await db.close();
  }
});

Deno.test("the batch gauges read Postgres once per scrape, at most once per refreshMs, and keep their values when a read fails", async () => {
  const db = await createTestDatabase();
  try {
    let reads = 0;
    let failing = false;
    // Counts the statements the gauges send (each a call of the tagged template).
    const sql = new Proxy(db.sql, {
      apply(target, self, args) {
        reads++;
        if (failing) return Promise.reject(new Error("Postgres is away"));
        return Reflect.apply(target, self, args);
      },
    });
    let now = 0;
    const registry = new Registry();
    batchMetrics(registry, { sql }, { deployments: ["east"], refreshMs: 2_000, now: () => now });
    const open = (text: string) => series(text, "oncely_batches_in_flight", ["deployment", "state"])["east/open"];
    await plantBatch(db.sql, { deployment: "east", state: "open", ageS: 10, lines: [null] });
    // Two scrapes at once (two Prometheus servers), three gauges each: one read.
    const [first, second] = await Promise.all([registry.metrics(), registry.metrics()]);
    assert.equal(reads, 1);
    assert.equal(open(first), 1);
    assert.equal(open(second), 1);
    await plantBatch(db.sql, { deployment: "east", state: "closed", ageS: 5, lines: [null] });
    now = 1_000;
    assert.equal(open(await registry.metrics()), 1, "within refreshMs: the last read's figures");
    assert.equal(reads, 1);
    now = 2_500;
    const fresh = await registry.metrics();
    assert.equal(reads, 2);
    assert.equal(series(fresh, "oncely_batch_runs_waiting", ["deployment"]).east, 2, "read again after refreshMs");
    failing = true;
    now = 5_000;
    const kept = await registry.metrics();
    assert.equal(reads, 3);
    assert.equal(series(kept, "oncely_batch_runs_waiting", ["deployment"]).east, 2, "a failed read keeps the values");
    failing = false;
    now = 5_001;
    await registry.metrics();
    assert.equal(reads, 4, "a failed read is not kept: the next scrape reads again");
  } finally {
    await db.close();
  }
});

/** Each scan of a plan (`EXPLAIN (FORMAT JSON)`): its node type, table and index. */
function scans(plan: Record<string, unknown>): { node: string; table?: string; index?: string }[] {
  const here = typeof plan["Relation Name"] === "string"
    ? [{
      node: plan["Node Type"] as string,
      table: plan["Relation Name"] as string,
      index: plan["Index Name"] as string,
    }]
    : typeof plan["Index Name"] === "string"
    ? [{ node: plan["Node Type"] as string, index: plan["Index Name"] as string }]
    : [];
  return [...here, ...((plan.Plans ?? []) as Record<string, unknown>[]).flatMap(scans)];
}

Deno.test("the gauges' query reads the batches in flight and their unsettled runs through indexes, not the history", async () => {
  const db = await createTestDatabase();
  try {
    // History: 5,000 committed batches of 20 settled lines. In flight: 10 batches of 2,000 runs, half settled.
    await db.sql`
      INSERT INTO batches (id, deployment, model, state, runs, opened_at, committed_at)
      SELECT gen_random_uuid(), 'east', 'm', 'committed', 20, now() - interval '2 days', now()
      FROM generate_series(1, 5000)`;
    await db.sql`
      INSERT INTO batch_runs (run_id, batch_id, tenant, payload, request, in_file, settled)
      SELECT gen_random_uuid(), b.id, 'acme', 'x', '{}'::jsonb, true, 'committed' FROM batches b, generate_series(1, 20)`;
    await db.sql`
      INSERT INTO batches (id, deployment, model, state, runs, opened_at)
      SELECT gen_random_uuid(), 'east', 'm' || g, 'submitted', 2000, now() - interval '1 hour'
      FROM generate_series(1, 10) g`;
    await db.sql`
      INSERT INTO batch_runs (run_id, batch_id, tenant, payload, request, in_file, settled)
      SELECT gen_random_uuid(), b.id, 'acme', 'x', '{}'::jsonb, true, CASE WHEN g % 2 = 0 THEN 'committed' END
      FROM batches b, generate_series(1, 2000) g WHERE b.state = 'submitted'`;
    await db.sql`ANALYZE batches`;
    await db.sql`ANALYZE batch_runs`;
    // The statement the gauges send, as they send it (it takes no parameter).
    let statement: string | undefined;
    const sql = new Proxy(db.sql, {
      apply(target, self, args) {
        const strings = args[0] as TemplateStringsArray;
        assert.equal(strings.length, 1, "no parameter");
        statement = strings[0];
        return Reflect.apply(target, self, args);
      },
    });
    const registry = new Registry();
    batchMetrics(registry, { sql }, { deployments: ["east"], refreshMs: 0 });
    const text = await registry.metrics();
    assert.equal(series(text, "oncely_batch_runs_waiting", ["deployment"]).east, 10_000);
    assert.equal(series(text, "oncely_batches_in_flight", ["deployment", "state"])["east/submitted"], 10);
    const [row] = await db.sql.unsafe(`EXPLAIN (FORMAT JSON) ${statement!}`);
    const all = scans((row!["QUERY PLAN"] as { Plan: Record<string, unknown> }[])[0]!.Plan);
    assert.ok(!all.some((s) => s.node === "Seq Scan"), JSON.stringify(all));
    assert.ok(all.some((s) => s.index === "batches_unfinished"), JSON.stringify(all));
    assert.ok(all.some((s) => s.index === "batch_runs_unsettled"), JSON.stringify(all));
    assert.ok(!all.some((s) => s.index === "batch_runs_batch"), "not every run of the batches in flight");
  } finally {
    await db.close();
  }
});

Deno.test("lines settled are counted once each by outcome: committed, failed, online, left_out", async () => {
  // Of the file's 5 lines: the second is refused (400: failed), the third fails transiently (500: online).
  const world = await batchWorld({
    maxRuns: 6,
    script: () => ({
      line: (_id, _body, i) =>
        i === 1
          ? { kind: "error", status: 400, message: "bad request" }
          : i === 2
          ? { kind: "error", status: 500 }
          : { kind: "ok", usage: { prompt_tokens: 100, completion_tokens: 20 } },
    }),
  });
  try {
    const registry = new Registry();
    const events = batchMetrics(registry, world, { deployments: [DEPLOYMENT], refreshMs: 0 });
    const runIds = await world.recordRuns(6);
    // Cancelled while its batch collected: left out of the file.
    await world
      .sql`INSERT INTO job_outcomes (job_id, tenant, outcome) VALUES (${runIds[0]!}::uuid, 'acme', 'cancelled')`;
    await createBatchSubmitter(world, { maxWaitMs: 3_600_000, onSettled: events.settled }).runOnce();
    /** The deployment's settled lines by outcome (its label checked too). */
    const counted = async () =>
      Object.fromEntries(
        Object.entries(series(await registry.metrics(), "oncely_batch_lines_settled_total", ["deployment", "outcome"]))
          .map(([k, v]) => [k.startsWith(`${DEPLOYMENT}/`) ? k.slice(DEPLOYMENT.length + 1) : k, v]),
      );
    assert.deepEqual(await counted(), { committed: 0, failed: 0, online: 0, left_out: 1 });
    const poller = (fault?: () => void) =>
      createBatchPoller({ ...world, committer: createGroupCommitter({ sql: world.sql, log: world.log }) }, {
        onExpiry: "online",
        online: () => Promise.resolve(),
        prices: createPrices({ LLM_PRICES: { [MODEL]: { in: 2, out: 8 } } }),
        leaseMs: 0,
        onSettled: events.settled,
        fault,
      });
    // A poller stopped after its second line, then another: the lines the first settled are not counted again.
    let settled = 0;
    await assert.rejects(
      poller(() => {
        if (++settled === 2) throw new Crash("line_settled");
      }).runOnce(),
      Crash,
    );
    assert.equal(Object.values(await counted()).reduce((a, b) => a + b), 1 + 2);
    assert.equal(await poller().runOnce(), 1);
    const text = await registry.metrics();
    assert.deepEqual(await counted(), { committed: 3, failed: 1, online: 1, left_out: 1 });
    const [rows] = await world.sql<{ n: number }[]>`
      SELECT count(*)::int AS n FROM batch_runs WHERE settled IS NOT NULL`;
    assert.equal(rows!.n, 6, "every run's line settled, each counted once");
    // A line settled again (two processes racing over one line) is settled, and counted, by one of them.
    assert.equal(await settleBatchRun(world.sql, runIds[1]!, "committed"), undefined);
    assert.deepEqual(await counted(), { committed: 3, failed: 1, online: 1, left_out: 1 });
    assert.deepEqual(series(text, "oncely_batches_in_flight", ["deployment", "state"])[`${DEPLOYMENT}/ended`], 0);
    await promtoolClean(text);
  } finally {
    await world.close();
  }
});

Deno.test("a worker's batch services register the batch metrics with a batch deployment, and none without", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  try {
    const build = (batch: boolean) => {
      const config = parseConfig(deploymentsEnv([
        deployment("east", { models: [MODEL], batch }),
        deployment("west", { models: [MODEL] }),
      ], { OPENAI_MODEL: MODEL }));
      const registry = new Registry();
      const built = buildBatches({
        config,
        sql: db.sql,
        redis: r.redis,
        log: silentLogger,
        keys: serviceKeys(KEY_PREFIX),
        prices: createPrices(config),
        registry,
      });
      return { built, registry };
    };
    const off = build(false);
    assert.equal(off.built, undefined);
    assert.deepEqual(off.registry.getMetricsAsArray(), [], "no batch deployment: no batch metric, no query");
    const on = build(true);
    assert.deepEqual(on.built?.deployments, ["east"]);
    const text = await on.registry.metrics();
    assert.deepEqual(
      [...new Set(samples(text).map((s) => s.name))].sort(),
      [
        "oncely_batch_lines_settled_total",
        "oncely_batch_oldest_in_flight_seconds",
        "oncely_batch_runs_waiting",
        "oncely_batches_in_flight",
      ],
    );
    assert.deepEqual(series(text, "oncely_batch_runs_waiting", ["deployment"]), { east: 0 }, "its batch deployment");
    await promtoolClean(text);
  } finally {
    await r.close();
    await db.close();
  }
});
