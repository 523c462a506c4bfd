/**
 * The flow scripts applied twice, as ioredis's resend of an unanswered command applies them (issue 35): the same
 * call, with the same arguments, run again after Redis already ran it. Each must leave the provider's state as one
 * run does and answer what the first run decided.
 */
import assert from "node:assert/strict";
import { Redis } from "ioredis";
import { APIError } from "openai";
import { fromOpenAiError } from "../../src/llm/openai_errors.ts";
import { createLogger } from "../../src/log/logger.ts";
import { type AcquireRequest, type AcquireSettings, runAcquire } from "../../src/provider/acquire_script.ts";
import { createProviderFlow, FLOW_DEFAULTS, providerStateKey } from "../../src/provider/flow_control.ts";
import { replyMemoKey } from "../../src/provider/reply_memo.ts";
import { runSettle, type SettleOutcome, type SettleSettings } from "../../src/provider/settle_script.ts";
import { createTestRedis, deleteByPrefix, REDIS_URL } from "../_support.ts";
import { startRedisDropProxy } from "../support/redis_drop_proxy.ts";
import { resendingRedis } from "../support/resending_redis.ts";

const silent = createLogger({ write: () => {} });

function acquireSettings(limits: { rpm?: number; tpm?: number } = {}): AcquireSettings {
  return {
    cfg_rpm: limits.rpm ?? 0,
    cfg_tpm: limits.tpm ?? 0,
    max_ahead_ms: FLOW_DEFAULTS.maxAheadMs,
    lease_ms: 5_000,
    margin: FLOW_DEFAULTS.margin,
    horizon_ms: FLOW_DEFAULTS.horizonMs,
    suspect_delay_ms: FLOW_DEFAULTS.suspectProbeDelayMs,
    state_ttl_ms: FLOW_DEFAULTS.stateTtlMs,
    reply_ttl_ms: FLOW_DEFAULTS.replyTtlMs,
  };
}

function settleSettings(limits: { tpm?: number } = {}): SettleSettings {
  return {
    threshold: FLOW_DEFAULTS.failureThreshold,
    cooldown_ms: 300,
    max_cooldown_ms: 600,
    growth: FLOW_DEFAULTS.cooldownGrowth,
    margin: FLOW_DEFAULTS.margin,
    cfg_tpm: limits.tpm ?? 0,
    min_pause_ms: FLOW_DEFAULTS.minPauseMs,
    max_pause_ms: FLOW_DEFAULTS.maxPauseMs,
    window_ms: FLOW_DEFAULTS.recentWindowMs,
    bad_ttl_ms: FLOW_DEFAULTS.badJobTtlMs,
    reply_ttl_ms: FLOW_DEFAULTS.replyTtlMs,
  };
}

const take = (est: number, job = ""): AcquireRequest => ({ mode: "take", est, probe_id: crypto.randomUUID(), job });

function outcome(kind: string, fields: Partial<SettleOutcome> = {}): SettleOutcome {
  return {
    kind,
    est: 100,
    actual: -1,
    probe_id: "",
    retry_after_ms: -1,
    limit_req: -1,
    limit_tok: -1,
    remaining_req: -1,
    remaining_tok: -1,
    reset_req_ms: -1,
    reset_tok_ms: -1,
    job: "",
    ...fields,
  };
}

function apiError(status: number, code: string) {
  const body = { message: `scripted ${status}`, type: code, param: null, code };
  return fromOpenAiError(APIError.generate(status, { error: body }, body.message, new Headers()));
}

Deno.test("the flow scripts applied twice change the provider's state once", async (t) => {
  const r = await createTestRedis();
  let n = 0;
  /** A fresh provider state key, and a memo for one flow's calls of each script. */
  const provider = () => {
    const key = providerStateKey(r.prefix, { baseURL: `http://twice${n++}`, model: "m", apiKey: "k" });
    const owner = crypto.randomUUID();
    return {
      key,
      acquire: () => ({ key: replyMemoKey(key, owner, "acquire"), callId: crypto.randomUUID() }),
      settle: () => ({ key: replyMemoKey(key, owner, "settle"), callId: crypto.randomUUID() }),
    };
  };
  const state = (key: string) => r.redis.hgetall(key);
  try {
    await t.step("a batch of takes resent books its slots once and answers the first run's waits", async () => {
      const p = provider();
      const settings = acquireSettings({ rpm: 600, tpm: 600_000 });
      const batch = [take(1_000), take(1_000), take(1_000)];
      const memo = p.acquire();
      const first = await runAcquire(r.redis, p.key, settings, batch, memo);
      const once = await state(p.key);
      const again = await runAcquire(r.redis, p.key, settings, batch, memo);
      assert.deepEqual(again, first);
      // Three slots, not six: the resend booked no permit that nobody will use.
      assert.deepEqual(await state(p.key), once);
      assert.deepEqual(first.map(([code]) => code), [1, 1, 1]);
      // A new call of the same flow is a new operation: it books the fourth slot, three intervals (~105 ms) on.
      const [[code, waitMs]] = await runAcquire(r.redis, p.key, settings, [take(1_000)], p.acquire()) as [
        [number, number, string],
      ];
      assert.equal(code, 1);
      assert.ok(waitMs > 250 && waitMs <= 320, `the fourth slot is ${waitMs} ms away`);
    });

    await t.step("a probe's take resent still holds the probe, instead of waiting for its own lease", async () => {
      const p = provider();
      // No limit known yet: one call at a time, and that call is the probe.
      const settings = acquireSettings();
      const request = take(10, "job-1");
      const memo = p.acquire();
      const first = await runAcquire(r.redis, p.key, settings, [request], memo);
      assert.deepEqual(first, [[2, 0, "probe"]]);
      const once = await state(p.key);
      assert.deepEqual(await runAcquire(r.redis, p.key, settings, [request], memo), first);
      assert.deepEqual(await state(p.key), once);
      assert.equal(once.probe_id, request.probe_id);
    });

    await t.step("a settle resent gives the unused tokens back once", async () => {
      const p = provider();
      const limits = { tpm: 60_000 };
      await runAcquire(r.redis, p.key, acquireSettings(limits), [take(5_000)], p.acquire());
      const booked = Number((await state(p.key)).tat_tok);
      const outcomes = [outcome("ok", { est: 5_000, actual: 500 })];
      const memo = p.settle();
      const first = await runSettle(r.redis, p.key, settleSettings(limits), outcomes, memo);
      const once = await state(p.key);
      assert.ok(Number(once.tat_tok) < booked, "4,500 tokens given back");
      assert.deepEqual(await runSettle(r.redis, p.key, settleSettings(limits), outcomes, memo), first);
      assert.deepEqual(await state(p.key), once);
    });

    await t.step("a failure resent counts once, and its reply still tells that it opened the breaker", async () => {
      const p = provider();
      const memo = p.settle();
      const failures = [outcome("provider", { job: "" }), outcome("quota", { job: "job-9" })];
      const first = await runSettle(r.redis, p.key, settleSettings(), failures, memo);
      assert.deepEqual(first[1]!.slice(0, 4), [1, "closed", "open", "insufficient_quota"]);
      const once = await state(p.key);
      assert.equal(once.failures, "1");
      // The first failure is charged to its job (the provider is not failing for everyone), the quota to the provider.
      assert.deepEqual([once.recent_job, once.recent_provider], ["1", "1"]);
      const again = await runSettle(r.redis, p.key, settleSettings(), failures, memo);
      // Without the memo, the second run answers "open" to "open": the caller never logs the quota exhausted.
      assert.deepEqual(again, first);
      assert.deepEqual(await state(p.key), once);
    });

    await t.step("a probe's failure resent is charged and opens the breaker as the first run decided", async () => {
      const p = provider();
      const request = take(10, "job-2");
      await runAcquire(r.redis, p.key, acquireSettings(), [request], p.acquire());
      const failed = [outcome("provider", { probe_id: request.probe_id, job: "job-2" })];
      // Two other jobs failed first: the provider is suspect, so the third distinct failure opens it.
      await runSettle(r.redis, p.key, settleSettings(), [
        outcome("provider", { job: "job-a" }),
        outcome("provider", { job: "job-b" }),
      ], p.settle());
      const memo = p.settle();
      const first = await runSettle(r.redis, p.key, settleSettings(), failed, memo);
      assert.deepEqual(first[0]!.slice(0, 4), [1, "closed", "open", "consecutive_failures"]);
      const once = await state(p.key);
      assert.deepEqual(await runSettle(r.redis, p.key, settleSettings(), failed, memo), first);
      assert.deepEqual(await state(p.key), once);
    });

    await t.step("through a client that sends every script call twice, a probe is granted at once", async () => {
      // Learning the limits: one call at a time. Run twice without the memo, the take's second run finds the
      // probe lease its first run took, answers "probing", and the caller waits until that lease runs out.
      const key = provider().key;
      const flow = createProviderFlow({ redis: resendingRedis(r.redis), log: silent }, {
        key,
        cooldownMs: 300,
        probeLeaseMs: 10_000,
      });
      const started = performance.now();
      const permit = await flow.acquire(10, AbortSignal.timeout(3_000), "job-3");
      assert.equal(permit.probe, true);
      assert.ok(performance.now() - started < 2_000, `granted after ${performance.now() - started} ms`);
      await permit.settle({
        value: { text: "ok", usage: { prompt_tokens: 5, completion_tokens: 5, total_tokens: 10 } },
      });
      await flow.settled();
      const status = await flow.status();
      assert.equal(status.learning, false);
      assert.equal(status.breaker.state, "closed");
    });

    await t.step(
      "through a client that sends every script call twice, tokens are booked and given back once",
      async () => {
        const key = provider().key;
        const flow = createProviderFlow({ redis: resendingRedis(r.redis), log: silent }, {
          key,
          tpm: 60_000,
          cooldownMs: 300,
          probeLeaseMs: 10_000,
        });
        const [s, us] = await r.redis.time();
        const before = Number(s) * 1_000 + Math.floor(Number(us) / 1_000);
        // 6,000 tokens are 6 s of a 60,000/min limit: booked twice, the second run would find the slot more than a
        // second away and the caller would wait for it.
        const permit = await flow.acquire(6_000, AbortSignal.timeout(3_000), "job-4");
        await permit.settle({
          value: { text: "ok", usage: { prompt_tokens: 0, completion_tokens: 0, total_tokens: 600 } },
        });
        await flow.settled();
        const interval = 60_000 / (60_000 * FLOW_DEFAULTS.margin);
        // Booked 6,000 tokens once and gave back the 5,400 it did not use once: 600 tokens' worth after the take.
        const booked = Number((await state(key)).tat_tok) - before;
        assert.ok(booked > 600 * interval - 1 && booked < 600 * interval + 200, `${booked} ms of tokens booked`);
      },
    );
  } finally {
    await r.close();
  }
});

Deno.test({
  name: "a flow call whose reply is lost with its connection is resent by ioredis and applied once",
  // The proxy stands in front of the one local server.
  ignore: Deno.env.get("ONCELY_TEST_CLUSTER") === "1",
  async fn() {
    let armed = false;
    const proxy = startRedisDropProxy({
      target: { hostname: "127.0.0.1", port: Number(new URL(REDIS_URL).port) },
      share: 1,
      // Exactly one reply is lost: the next one on the flow's connection once armed.
      dropOn: (c) => {
        if (!armed || c.name !== "twice-flow") return false;
        armed = false;
        return true;
      },
    });
    const redis = new Redis(proxy.url(), { connectionName: "twice-flow", maxRetriesPerRequest: null });
    const prefix = `oncely_test_${crypto.randomUUID().slice(0, 8)}`;
    const key = providerStateKey(prefix, { baseURL: "http://dropped", model: "m", apiKey: "k" });
    try {
      const flow = createProviderFlow({ redis, log: silent }, { key, cooldownMs: 300, probeLeaseMs: 10_000 });
      await redis.ping();
      armed = true;
      const started = performance.now();
      const permit = await flow.acquire(10, AbortSignal.timeout(5_000), "job-7");
      assert.equal(proxy.stats.drops, 1, "the take's reply was lost");
      assert.equal(permit.probe, true);
      assert.ok(performance.now() - started < 3_000, `granted after ${performance.now() - started} ms`);
      armed = true;
      await permit.settle({ error: apiError(500, "server_error") });
      assert.equal(proxy.stats.drops, 2, "the settle's reply was lost");
      const status = await flow.status();
      assert.equal(status.breaker.failures, 1, "the failure counted once");
      assert.equal(status.recent_failures.provider + status.recent_failures.job, 1);
    } finally {
      await deleteByPrefix(redis, prefix);
      await redis.quit();
      await proxy.close();
    }
  },
});
