/**
 * A run may wait in its lane for weeks (a monthly budget, a provider's outage). Its status record does not expire
 * while it waits: it stays `GET`-able and cancellable, and a re-POST of its key, long after the key's own record
 * expired, is a replay, not a second copy in the lane. The record's lifetime starts when its message is
 * acknowledged; the test shortens both lifetimes (the key's record and the acknowledged job's) to a second.
 */
import assert from "node:assert/strict";
import { createIntake } from "../../src/runs/intake.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { SUMMARIES } from "../../src/summaries/api.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { deadLetter, replayDeadLetter } from "../../src/queue/dead_letter.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import { markFailedHook, markQueuedOnReplay } from "../../src/runs/job_status.ts";
import { apiHandler, jsonClient, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const TEXT = "Revenue rose 12% in Q3 thanks to enterprise revenue. Costs fell. The board was pleased.";

Deno.test("a queued job outlives its key's record and every old lifetime: GET, DELETE and a re-POST replay", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", resultTtlS: 2 });
  const call = jsonClient(api, await createApiKey(db.sql, "acme"));
  const lane = keys.lane("acme");
  const post = (key: string) =>
    call("POST", "/v1/summaries", { text: TEXT, notify: "a@example.com" }, { "idempotency-key": key });
  try {
    const cancelled = await post("long-wait-key-0001");
    const finished = await post("long-wait-key-0002");
    assert.deepEqual([cancelled.status, finished.status], [202, 202]);
    const a = cancelled.body.job_id as string;
    const b = finished.body.job_id as string;
    // No expiry while queued (it was 7 days, after which GET and DELETE answered 404 and a re-POST enqueued again).
    assert.equal(await r.redis.ttl(lane.job(a)), -1);
    assert.equal(await r.redis.ttl(lane.job(b)), -1);

    // The keys' own records expire (here 2 s after the second they were written in, so 1 to 2 s later: at 1 s, a
    // record written late in a second was gone before a loaded Redis Cluster run could look; a day by default).
    const records = createIntake({ redis: r.redis }, { keys, resultTtlS: 2, path: SUMMARIES });
    const idemRecords = async () =>
      (await Promise.all(
        ["long-wait-key-0001", "long-wait-key-0002"].map((key) =>
          records.hasRecord({ tenant: "acme", method: "POST", path: SUMMARIES, key })
        ),
      )).filter(Boolean).length;
    assert.equal(await idemRecords(), 2);
    await waitFor("the keys' records to expire", async () => (await idemRecords()) === 0);
    const again = await post("long-wait-key-0001");
    assert.equal(again.status, 202);
    assert.equal(again.headers.get("idempotent-replayed"), "true");
    assert.equal(again.body.job_id, a);
    assert.equal(await r.redis.xlen(lane.stream), 2, "the re-POST did not queue the job a second time");

    assert.equal((await call("GET", `/v1/summaries/${a}`)).body.status, "queued");
    assert.equal((await call("DELETE", `/v1/summaries/${a}`)).status, 200);
    assert.equal((await call("GET", `/v1/summaries/${a}`)).body.status, "cancelled");

    // A worker takes the jobs: the record's lifetime (1 s here) starts with each message's acknowledgement.
    const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm: createExtractiveLlm(), keys }, { recordTtlS: 1 });
    try {
      await waitFor("every job acknowledged", async () => {
        await worker.runOnce(10);
        return await r.redis.xlen(lane.stream) === 0;
      });
    } finally {
      await worker.close();
    }
    const ttl = await r.redis.ttl(lane.job(b));
    // 1 or 0 while it lasts, -2 once gone (a slow close): never -1, and never the old 7 days.
    assert.ok(ttl <= 1 && ttl !== -1, `the done job's record expires a second after its ack (TTL ${ttl})`);
    await waitFor(
      "the acknowledged jobs' records to expire",
      async () => (await r.redis.exists(lane.job(a), lane.job(b))) === 0,
    );
    // Postgres answers once the records are gone.
    assert.equal((await call("GET", `/v1/summaries/${a}`)).body.status, "cancelled");
    assert.equal((await call("GET", `/v1/summaries/${b}`)).body.status, "done");
    const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM summaries WHERE job_id = ${b}`;
    assert.equal(row?.n, 1);
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("a dead-lettered job's record expires; replayed, it waits again without expiry", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key" });
  const call = jsonClient(api, await createApiKey(db.sql, "acme"));
  const lane = keys.lane("acme");
  try {
    const posted = await call("POST", "/v1/summaries", { text: TEXT, notify: "a@example.com" }, {
      "idempotency-key": "long-wait-dead-0001",
    });
    const jobId = posted.body.job_id as string;
    await ensureGroup(r.redis, lane);
    const reply = await r.redis.xreadgroup("GROUP", lane.group, "c", "COUNT", 1, "STREAMS", lane.stream, ">") as [
      string,
      [string, string[]][],
    ][];
    const [id] = reply[0]![1][0]!;
    await deadLetter(
      r.redis,
      lane,
      { id, fields: { job_id: jobId, tenant: "acme" }, deliveries: 1 },
      "x",
      markFailedHook,
    );
    assert.ok((await r.redis.ttl(lane.job(jobId))) > 0, "a failed job's record has its lifetime");
    const [dead] = await r.redis.xrange(lane.dead, "-", "+");
    assert.ok(await replayDeadLetter(r.redis, lane, dead![0], markQueuedOnReplay(lane, jobId)));
    assert.equal(await r.redis.hget(lane.job(jobId), "status"), "queued");
    assert.equal(await r.redis.ttl(lane.job(jobId)), -1, "queued again: no expiry while it waits");
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("a run cancelled while it waited longer than its outcome's retention is not run", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key" });
  const call = jsonClient(api, await createApiKey(db.sql, "acme"));
  const lane = keys.lane("acme");
  let calls = 0;
  const extractive = createExtractiveLlm();
  const llm: typeof extractive = {
    complete(prompt, options) {
      calls++;
      return extractive.complete(prompt, options);
    },
  };
  try {
    const posted = await call("POST", "/v1/summaries", { text: TEXT, notify: "a@example.com" }, {
      "idempotency-key": "long-wait-cancel-0001",
    });
    const jobId = posted.body.job_id as string;
    assert.equal((await call("DELETE", `/v1/summaries/${jobId}`)).status, 200);
    // It was accepted eight days ago and waited since (a month's budget); retention (SUMMARY_RETENTION_S) has
    // deleted its `cancelled` outcome meanwhile. Its record, which lives as long as it waits, still says cancelled.
    const [entry] = await r.redis.xrange(lane.stream, "-", "+");
    await r.redis.xdel(lane.stream, entry![0]);
    await r.redis.xadd(lane.stream, "*", ...entry![1], "accepted_ms", String(Date.now() - 8 * 86_400_000));
    await db.sql`DELETE FROM job_outcomes WHERE job_id = ${jobId}`;
    const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys });
    try {
      await waitFor("the message acknowledged", async () => {
        await worker.runOnce(10);
        return await r.redis.xlen(lane.stream) === 0;
      });
    } finally {
      await worker.close();
    }
    assert.equal(calls, 0, "no model call for a cancelled run");
    const [row] = await db.sql<{ s: number; o: number }[]>`
      SELECT (SELECT count(*) FROM summaries WHERE job_id = ${jobId})::int AS s,
        (SELECT count(*) FROM outbox WHERE dedupe_key LIKE ${"%" + jobId})::int AS o`;
    assert.deepEqual([row?.s, row?.o], [0, 0]);
  } finally {
    await r.close();
    await db.close();
  }
});
