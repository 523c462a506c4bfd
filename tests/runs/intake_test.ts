import assert from "node:assert/strict";
import { KeyReused } from "../../src/idempotency/errors.ts";
import { canonicalJson } from "../../src/idempotency/fingerprint.ts";
import { encodeScope, jobIdFor, type Scope, scopeDigest } from "../../src/idempotency/scope.ts";
import { createIntake, jobFingerprint } from "../../src/runs/intake.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createLaneRegistry } from "../../src/queue/lanes.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import { createTestRedis, waitFor } from "../_support.ts";
import { resendingRedis } from "../support/resending_redis.ts";

const PATH = "/v1/summaries";
const BODY = { text: "Revenue rose 12% in Q3. Costs fell. The board approved the plan.", notify: "ops@example.com" };
const OTHER = { ...BODY, text: "Another document entirely, sent with the same key." };
const RUN = { task: "triage", version: 3, payload: '{"task":"triage","version":3,"input":{"a":1}}' };

Deno.test("job ids do not change between releases: the same scope and body name the same job as before", () => {
  // Pinned: a retry after an upgrade must name the job its first attempt named.
  const scope = { tenant: "acme", method: "POST", path: "/v1/summaries", key: "order-2026-0001-x" };
  assert.equal(
    jobIdFor(scope, canonicalJson({ text: "Revenue rose. Costs fell.", notify: "ops@example.com" })),
    "3b99b9ce-7a16-5625-bb93-2f261947d271",
  );
  assert.equal(
    jobIdFor(
      { ...scope, tenant: "ténant", key: "k".repeat(128) },
      canonicalJson({ text: `é€ 漢字 \ud83d\ude00 ${"x".repeat(5000)}`, notify: { webhook: "https://h.example/x" } }),
    ),
    "000344c8-d60c-5e9f-9c55-c0a8f01bd334",
  );
});

Deno.test("a scope's digest and a job's fingerprint are short and fixed: records written before stay readable", () => {
  const scope = { tenant: "acme", method: "post", path: "/v1/summaries", key: "order-2026-0001-x" };
  // Pinned: a record names its scope by this digest; another digest would hide every record already written.
  assert.equal(scopeDigest(scope), "y0FE3z3J2SE_HcPvCWL5fH");
  assert.equal(scopeDigest({ ...scope, method: "POST" }), scopeDigest(scope), "the method's case is the scope's");
  assert.notEqual(scopeDigest({ ...scope, tenant: "acmf" }), scopeDigest(scope));
  assert.notEqual(scopeDigest({ ...scope, path: "/v1/tasks/t/runs" }), scopeDigest(scope));
  assert.equal(jobFingerprint("3b99b9ce-7a16-5625-bb93-2f261947d271"), "3b99b9ce7a165625");
});

/** The answers releases before issue 39 stored, one string key per scope, exactly as they wrote them. */
const oldSummaryRecord = (jobId: string, path: string) =>
  `{"fp":"${jobId}","status":202,"body":{"job_id":"${jobId}","status":"queued"},"headers":{"location":${
    JSON.stringify(`${path}/${jobId}`)
  }}}`;
const oldRunRecord = (jobId: string) =>
  `{"fp":"${jobId}","status":202,"body":{"run_id":"${jobId}","status":"queued"},"headers":{"location":"/v1/runs/${jobId}"}}`;

Deno.test("intake records", async (t) => {
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  let n = 0;
  const scopeOf = (key = `records-key-${String(++n).padStart(8, "0")}`, path = PATH): Scope => ({
    tenant: "acme",
    method: "POST",
    path,
    key,
  });
  const lane = keys.lane("acme");
  try {
    await t.step(
      "a record is a field of its lane's hash of the period: the scope's digest, '<expiry>:<job fingerprint>'",
      async () => {
        const now = Date.UTC(2026, 0, 15, 12, 0, 30, 250);
        const intake = createIntake({ redis: r.redis, clock: { now: () => now } }, {
          keys,
          resultTtlS: 3600,
          path: PATH,
        });
        const scope = scopeOf();
        const { jobId, replayed } = await intake.submit({ scope, request: BODY });
        assert.equal(replayed, false);
        const hash = lane.idempotencyRecords(3600, Math.floor(now / 3_600_000));
        assert.deepEqual(await r.redis.hgetall(hash), {
          [scopeDigest(scope)]: `${Math.floor(now / 1000) + 3600}:${jobFingerprint(jobId)}`,
        });
        // It lives to the end of the next period, when its last record expires, and a minute more.
        const periodEnd = (Math.floor(now / 3_600_000) + 2) * 3600;
        assert.ok(Math.abs((await r.redis.ttl(hash)) - (periodEnd + 60 - Math.floor(now / 1000))) <= 2);
        assert.equal(await r.redis.exists(lane.idempotency(encodeScope(scope))), 0, "no key of its own");
        // A queued job's status record: its tenant, no status (read as queued).
        assert.deepEqual(await r.redis.hgetall(lane.job(jobId)), { tenant: "acme" });
      },
    );

    await t.step(
      "a replay answers byte for byte what the first request was answered, a summary's and a run's",
      async () => {
        const intake = createIntake({ redis: r.redis }, { keys, resultTtlS: 600, path: PATH });
        const length = await r.redis.xlen(lane.stream);
        const scope = scopeOf();
        const first = await intake.submit({ scope, request: BODY });
        const again = await intake.submit({ scope, request: BODY });
        assert.equal(again.replayed, true);
        assert.equal(again.jobId, first.jobId);
        assert.equal(JSON.stringify(again.response), JSON.stringify(first.response));
        assert.equal(
          JSON.stringify(first.response),
          JSON.stringify({
            status: 202,
            body: { job_id: first.jobId, status: "queued" },
            headers: { location: `${PATH}/${first.jobId}` },
          }),
        );
        await assert.rejects(intake.submit({ scope, request: OTHER }), KeyReused);

        const runScope = scopeOf(undefined, "/v1/tasks/triage/runs");
        const run = await intake.submitRun({ scope: runScope, request: { input: { a: 1 } }, run: RUN });
        const runAgain = await intake.submitRun({ scope: runScope, request: { input: { a: 1 } }, run: RUN });
        assert.equal(runAgain.replayed, true);
        assert.equal(JSON.stringify(runAgain.response), JSON.stringify(run.response));
        assert.equal(
          JSON.stringify(run.response),
          JSON.stringify({
            status: 202,
            body: { run_id: run.jobId, status: "queued" },
            headers: { location: `/v1/runs/${run.jobId}` },
          }),
        );
        assert.deepEqual(await r.redis.hgetall(lane.job(run.jobId)), { tenant: "acme", task: "triage", version: "3" });
        await assert.rejects(
          intake.submitRun({ scope: runScope, request: { input: { a: 2 } }, run: RUN }),
          KeyReused,
        );
        assert.equal(await r.redis.xlen(lane.stream), length + 2, "each job once");
      },
    );

    await t.step(
      "a record lives its TTL to the second, across a period's end: then a reused key names a new job",
      async () => {
        const ttl = 60;
        // Written 10 s before its period ends: it is found in the next period's look at the previous hash.
        const writtenAt = Date.UTC(2026, 0, 15, 12, 0, 50, 0);
        let now = writtenAt;
        const intake = createIntake({ redis: r.redis, clock: { now: () => now } }, {
          keys,
          resultTtlS: ttl,
          path: PATH,
        });
        const scope = scopeOf();
        const first = await intake.submit({ scope, request: BODY });
        now = writtenAt + ttl * 1000 - 1;
        assert.equal(await intake.hasRecord(scope), true);
        await assert.rejects(intake.submit({ scope, request: OTHER }), KeyReused, "reused within its lifetime");
        assert.equal((await intake.submit({ scope, request: BODY })).replayed, true);
        now = writtenAt + ttl * 1000;
        assert.equal(await intake.hasRecord(scope), false, "expired");
        const second = await intake.submit({ scope, request: OTHER });
        assert.equal(second.replayed, false, "a new job for another body once the record expired");
        assert.notEqual(second.jobId, first.jobId);
        // The first body again: the scope's record now names the second job.
        await assert.rejects(intake.submit({ scope, request: BODY }), KeyReused);
      },
    );

    await t.step(
      "a period's first record unlinks the hash of two periods before, whose records have all expired",
      async () => {
        const ttl = 60;
        const start = Date.UTC(2026, 0, 15, 13, 0, 0, 0);
        let now = start;
        const intake = createIntake({ redis: r.redis, clock: { now: () => now } }, {
          keys,
          resultTtlS: ttl,
          path: PATH,
        });
        const index = (at: number) => Math.floor(at / (ttl * 1000));
        await intake.submit({ scope: scopeOf(), request: BODY });
        now = start + ttl * 1000;
        await intake.submit({ scope: scopeOf(), request: BODY });
        assert.equal(await r.redis.exists(lane.idempotencyRecords(ttl, index(start))), 1);
        now = start + 2 * ttl * 1000;
        await intake.submit({ scope: scopeOf(), request: BODY });
        assert.equal(await r.redis.exists(lane.idempotencyRecords(ttl, index(start))), 0);
        assert.equal(await r.redis.exists(lane.idempotencyRecords(ttl, index(start) + 1)), 1);
      },
    );

    await t.step("the script resent after a lost reply enqueues once and answers the same job", async () => {
      const intake = createIntake({ redis: resendingRedis(r.redis) }, { keys, resultTtlS: 600, path: PATH });
      const length = await r.redis.xlen(lane.stream);
      const scopes = [scopeOf(), scopeOf()];
      const results = await Promise.all(scopes.map((scope, i) => intake.submit({ scope, request: i ? OTHER : BODY })));
      for (const [i, result] of results.entries()) {
        assert.equal(result.jobId, jobIdFor(scopes[i]!, canonicalJson(i ? OTHER : BODY)));
        // The second run found the first's record: a replay, answered as the first run would have been.
        assert.equal(result.replayed, true);
        assert.equal(JSON.stringify(result.response.body), JSON.stringify({ job_id: result.jobId, status: "queued" }));
      }
      assert.equal(await r.redis.xlen(lane.stream), length + 2, "each job once");
    });

    await t.step(
      "a record that a release before issue 39 stored is still answered: its stored answer, or 422 for another body",
      async () => {
        const intake = createIntake({ redis: r.redis }, { keys, resultTtlS: 600, path: PATH });
        const scope = scopeOf();
        const jobId = jobIdFor(scope, canonicalJson(BODY));
        const old = oldSummaryRecord(jobId, PATH);
        await r.redis.set(lane.idempotency(encodeScope(scope)), old, "EX", 600);
        const length = await r.redis.xlen(lane.stream);
        assert.equal(await intake.hasRecord(scope), true);
        const replay = await intake.submit({ scope, request: BODY });
        assert.equal(replay.replayed, true);
        assert.equal(replay.jobId, jobId);
        const { fp: _, ...answer } = JSON.parse(old);
        assert.equal(JSON.stringify(replay.response), JSON.stringify(answer));
        await assert.rejects(intake.submit({ scope, request: OTHER }), KeyReused);
        assert.equal(await r.redis.xlen(lane.stream), length, "nothing enqueued");
        const hash = lane.idempotencyRecords(600, Math.floor(Date.now() / 600_000));
        assert.equal(await r.redis.hexists(hash, scopeDigest(scope)), 0, "not stored again in the new form");

        const runScope = scopeOf(undefined, "/v1/tasks/triage/runs");
        const runId = jobIdFor(runScope, canonicalJson({ input: { a: 1 } }));
        await r.redis.set(lane.idempotency(encodeScope(runScope)), oldRunRecord(runId), "EX", 600);
        const run = await intake.submitRun({ scope: runScope, request: { input: { a: 1 } }, run: RUN });
        assert.equal(run.replayed, true);
        assert.deepEqual(run.response.body, { run_id: runId, status: "queued" });
        assert.equal(await r.redis.xlen(lane.stream), length, "nothing enqueued");

        await intake.forget(scope);
        assert.equal(await intake.hasRecord(scope), false);
        assert.equal(await r.redis.exists(lane.idempotency(encodeScope(scope))), 0);
      },
    );
  } finally {
    await r.close();
  }
});

Deno.test("intake adds a lane to every lane only when it is not among the lanes with work, wakes workers for every job, and leaves no job unannounced", async (t) => {
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const { active, wake } = keys.registry;
  const intake = createIntake({ redis: r.redis }, { keys, resultTtlS: 86_400, path: PATH });
  let n = 0;
  const submit = (tenant: string) =>
    intake.submit({
      scope: { tenant, method: "POST", path: PATH, key: `announce-key-${++n}` },
      request: { ...BODY, text: `${BODY.text} (${n})` },
    });
  // The wake-ups published, in order. On one server the intake script publishes them; on a cluster the
  // announce after it does, once per POST as before, so their count is asserted on one server only.
  const subscriber = r.redis.duplicate();
  const woken: string[] = [];
  subscriber.on("message", (_channel: string, id: string) => woken.push(id));
  await subscriber.subscribe(wake);
  let markers = 0;
  /** The wake-ups published so far: a marker published after them on the same connection arrives after them. */
  const wakeups = async () => {
    const marker = `marker-${++markers}`;
    await r.redis.publish(wake, marker);
    await waitFor(`wake-up ${marker}`, () => woken.includes(marker));
    return woken.filter((id) => !id.startsWith("marker-"));
  };
  const inActive = async (tenant: string) => (await r.redis.sismember(active, tenant)) === 1;
  /** What a worker's take does: every undelivered message of the lane to `consumer` (the take that drains it). */
  const take = async (tenant: string) => {
    const lane = keys.lane(tenant);
    await ensureGroup(r.redis, lane);
    const reply = await r.redis.xreadgroup("GROUP", lane.group, "w", "COUNT", 100, "STREAMS", lane.stream, ">") as
      | [string, [string, string[]][]][]
      | null;
    return (reply?.[0]?.[1] ?? []).map(([, fields]) => fields[fields.indexOf("job_id") + 1]);
  };
  const oneServer = !r.redis.isCluster;
  // A worker's lane source, with no sweep within the test's time (but its first walk of the lanes).
  const registry = createLaneRegistry({ redis: r.redis, log: silentLogger }, {
    keys: keys.registry,
    lane: (id) => keys.lane(id),
    sweepMs: 600_000,
  });
  try {
    await t.step(
      "the first job of a lane adds it to every lane; each job wakes the workers (an idle one waits for that)",
      async () => {
        for (let i = 0; i < 3; i++) await submit("a");
        await waitFor("lane a among the lanes with work", () => inActive("a"));
        assert.equal(await r.redis.sismember(keys.registry.all, "a"), 1);
        // One wake-up per job: a lane left among those with work by a worker that stopped is known to no worker.
        if (oneServer) assert.deepEqual(await wakeups(), ["a", "a", "a"]);
      },
    );

    await t.step(
      "a job that lands after a take drained its lane, before the worker takes the lane out, is found by its look",
      async () => {
        const { jobId: first } = await submit("b");
        await waitFor("lane b among the lanes with work", () => inActive("b"));
        await registry.active(); // the worker learns lane b (its first walk, or the wake-up)
        assert.deepEqual(await take("b"), [first]); // the take that drained the lane
        const before = oneServer ? (await wakeups()).length : 0;
        const { jobId: late } = await submit("b"); // lane b is still among the lanes with work
        if (oneServer) assert.equal((await wakeups()).length, before + 1, "a wake-up all the same");
        // The worker's idle: takes the lane out, then looks again and finds the late job.
        const back = await registry.idle([keys.lane("b")]);
        assert.deepEqual(back.map((lane) => lane.streams[0]), [keys.lane("b").stream]);
        assert.ok(await inActive("b"), "the lane is back among the lanes with work");
        assert.deepEqual(await take("b"), [late]);
      },
    );

    await t.step(
      "a worker that dies between taking a lane out and its look: the next job announces the lane at once",
      async () => {
        const { jobId: first } = await submit("c");
        await waitFor("lane c among the lanes with work", () => inActive("c"));
        assert.deepEqual(await take("c"), [first]);
        const { jobId: second } = await submit("c"); // lands before the worker takes the lane out
        // The worker takes lane c out of the lanes with work, and dies before it looks again: lane c has an
        // undelivered job and is not among the lanes with work. (A lane's work is no sign that it is known.)
        await r.redis.srem(active, "c");
        await registry.active(); // news of everything before
        const { jobId: third } = await submit("c");
        await waitFor("lane c among the lanes with work again", () => inActive("c"));
        if (oneServer) assert.equal((await wakeups()).at(-1), "c", "the next job published a wake-up");
        // A worker learns the lane from that wake-up (or its walk of the lanes with work), not from the sweep.
        const named = await waitFor(
          "lane c named to the worker",
          async () => (await registry.active()).some((lane) => lane.streams[0] === keys.lane("c").stream),
        );
        assert.ok(named);
        assert.deepEqual(await take("c"), [second, third]);
      },
    );

    await t.step(
      "the same with no job after the crash: the sweep (LaneRegistryOptions.sweepMs) finds the lane",
      async () => {
        const { jobId: first } = await submit("d");
        await waitFor("lane d among the lanes with work", () => inActive("d"));
        assert.deepEqual(await take("d"), [first]);
        const { jobId: second } = await submit("d");
        await r.redis.srem(active, "d"); // the worker's removal, and then its death
        assert.equal(await inActive("d"), false);
        assert.ok(await registry.sweep() >= 1);
        assert.ok(await inActive("d"));
        assert.deepEqual(await take("d"), [second]);
      },
    );
  } finally {
    await registry.close();
    await subscriber.quit();
    await r.close();
  }
});
