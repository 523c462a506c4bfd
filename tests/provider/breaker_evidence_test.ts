/**
 * The breaker opens on evidence that the provider is failing, not that some documents are (issue 36), and a
 * limit in the shared state lasts only as long as its cause: a live process's configuration, or a provider that
 * still reports it. Every case runs on one provider key, one after another, as a service lives: each starts from
 * what the one before left (the steps' own jobs and tenants are new).
 */
import assert from "node:assert/strict";
import { APIError } from "openai";
import { createLogger } from "../../src/log/logger.ts";
import { fromOpenAiError } from "../../src/llm/openai_errors.ts";
import {
  createProviderFlow,
  type ProviderFlow,
  type ProviderFlowOptions,
  providerStateKey,
} from "../../src/provider/flow_control.ts";
import { AttemptTimeout, ConnectionError } from "../../src/retry/errors.ts";
import { createTestRedis } from "../_support.ts";

const silent = createLogger({ write: () => {} });
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function serverError(status: number, headers: Record<string, string> = {}) {
  const body = { message: `scripted ${status}`, type: "server_error", param: null, code: null };
  return fromOpenAiError(APIError.generate(status, { error: body }, body.message, new Headers(headers)));
}

const limitHeaders = (rpm: number, tpm: number) =>
  new Headers({
    "x-ratelimit-limit-requests": String(rpm),
    "x-ratelimit-remaining-requests": String(rpm - 1),
    "x-ratelimit-reset-requests": "1s",
    "x-ratelimit-limit-tokens": String(tpm),
    "x-ratelimit-remaining-tokens": String(tpm - 100),
    "x-ratelimit-reset-tokens": "60ms",
  });

Deno.test("the breaker weighs its evidence, and no limit outlives its cause", async (t) => {
  const r = await createTestRedis();
  const key = providerStateKey(r.prefix, { baseURL: "http://one-provider", model: "m", apiKey: "k" });
  const flows: ProviderFlow[] = [];
  const flowFor = (options: Partial<ProviderFlowOptions> = {}) => {
    const flow = createProviderFlow({ redis: r.redis, log: silent }, {
      key,
      rpm: 60_000,
      cooldownMs: 800,
      firstProbeMs: 100,
      probeLeaseMs: 2_000,
      ...options,
    });
    flows.push(flow);
    return flow;
  };
  let step = 0;
  /** Job and tenant names of this step alone (the provider key is shared by every step). */
  const ids = () => {
    const s = step++;
    return { job: (name: string) => `s${s}-${name}`, tenant: (name: string) => `t${s}-${name}` };
  };
  const ok = { value: { text: "ok" } };
  const withdrawAll = async () => {
    for (const flow of flows) await flow.withdraw();
  };
  const call = async (flow: ProviderFlow, job: string, tenant: string, outcome: object) =>
    await (await flow.acquire(10, undefined, job, tenant)).settle(outcome);
  /** Waits out an open breaker, as the jobs would, and has a fresh job's probe succeed. */
  const recover = async (flow: ProviderFlow, job: string) => {
    const probe = await flow.acquire(10, undefined, job, "recovery");
    await probe.settle(ok);
    assert.equal((await flow.status()).breaker.state, "closed");
  };

  try {
    await t.step("three documents of one tenant that always get a 500 are not an outage: each is charged", async () => {
      const flow = flowFor();
      const { job, tenant } = ids();
      const verdicts = [];
      for (let round = 0; round < 2; round++) {
        for (const name of ["a", "b", "c"]) {
          verdicts.push(await call(flow, job(name), tenant("bad"), { error: serverError(500) }));
        }
      }
      assert.deepEqual(verdicts, [false, false, false, false, false, false], "every failure is the job's own");
      const status = await flow.status();
      assert.equal(status.breaker.state, "closed");
      assert.equal(status.breaker.failures, 3);
      assert.equal(status.breaker.tenants, 1);
      // Another tenant's job is served: the three are known bad, and their failures count nowhere.
      assert.equal(await call(flow, job("good"), tenant("good"), ok), false);
      assert.equal((await flow.status()).breaker.failures, 0);
      for (const name of ["a", "b", "c"]) {
        assert.equal(await call(flow, job(name), tenant("bad"), { error: serverError(500) }), false);
      }
      assert.equal((await flow.status()).breaker.failures, 0, "known bad documents do not count");
    });

    await t.step(
      "the same failures from jobs of two tenants, most calls failing: an outage, the opener charged",
      async () => {
        await sleep(100); // the failures of the step before are in the window too: it has to be a share of all calls
        const flow = flowFor();
        const { job, tenant } = ids();
        const verdicts = [];
        for (const [name, who] of [["a", "x"], ["b", "y"], ["a", "x"], ["b", "y"], ["c", "x"]]) {
          verdicts.push(await call(flow, job(name!), tenant(who!), { error: new AttemptTimeout("scripted") }));
        }
        assert.deepEqual(verdicts, [false, false, false, false, false], "charged: it may still be the documents");
        const status = await flow.status();
        assert.equal(status.breaker.state, "open");
        assert.equal(status.breaker.reason, "failure_rate");
        assert.ok(status.breaker.probe_at! - status.now <= 100, "the first probe within firstProbeMs");
        // A fresh job's probe succeeds: the failing jobs were documents after all, and are known bad from now on.
        await recover(flow, job("fresh"));
        assert.equal(await call(flow, job("a"), tenant("x"), { error: new AttemptTimeout("again") }), false);
        assert.equal((await flow.status()).breaker.failures, 0, "a, b and c are known bad");
      },
    );

    await t.step("five jobs of one tenant failing, nothing served: an outage even for a lone tenant", async () => {
      const flow = flowFor();
      const { job, tenant } = ids();
      const verdicts = [];
      for (const name of ["a", "b", "c", "d", "e"]) {
        verdicts.push(await call(flow, job(name), tenant("only"), { error: new AttemptTimeout("scripted") }));
      }
      assert.deepEqual(verdicts, [false, false, false, false, false]);
      assert.equal((await flow.status()).breaker.state, "open");
      assert.equal((await flow.status()).breaker.reason, "failure_rate");
      await recover(flow, job("fresh"));
    });

    await t.step("with most calls served, three failing jobs of two tenants do not open it", async () => {
      const flow = flowFor();
      const { job, tenant } = ids();
      // 30 calls served in the window (after the failures of the steps before), then three failures.
      for (let i = 0; i < 30; i++) await call(flow, job(`ok${i}`), tenant("busy"), ok);
      for (const [name, who] of [["a", "x"], ["b", "y"], ["c", "y"]]) {
        assert.equal(await call(flow, job(name!), tenant(who!), { error: serverError(500) }), false);
      }
      const status = await flow.status();
      assert.equal(status.breaker.state, "closed", `failing share ${status.breaker.failing_share}`);
      assert.ok(status.breaker.failing_share! < 0.5);
      await call(flow, job("next"), tenant("busy"), ok);
    });

    await t.step(
      "failures no document causes open after three jobs of one tenant, absorbed; the victims are not bad documents",
      async () => {
        const flow = flowFor();
        const { job, tenant } = ids();
        const kinds = [new ConnectionError("refused"), serverError(503), serverError(500, { "retry-after": "2" })];
        const verdicts = [];
        for (const [i, error] of kinds.entries()) {
          verdicts.push(await call(flow, job(`v${i}`), tenant("one"), { error }));
        }
        assert.deepEqual(verdicts, [false, false, true], "the third is the provider's: absorbed");
        assert.equal((await flow.status()).breaker.reason, "consecutive_failures");
        await recover(flow, job("fresh"));
        // The same jobs fail again the same way: they count again (victims, not bad documents).
        const again = [];
        for (const [i, error] of kinds.entries()) again.push(await call(flow, job(`v${i}`), tenant("one"), { error }));
        assert.deepEqual(again, [false, false, true]);
        await recover(flow, job("fresh-2"));
      },
    );

    await t.step(
      "after it opens, the first probe goes out within firstProbeMs; a fresh job's failed probe doubles the wait " +
        "up to the cooldown; a failed job's probe does not",
      async () => {
        const flow = flowFor();
        const { job, tenant } = ids();
        for (const name of ["a", "b", "c"]) await call(flow, job(name), tenant("one"), { error: serverError(503) });
        const waits: number[] = [];
        const probeBy = async (name: string) => {
          const started = performance.now();
          const permit = await flow.acquire(10, undefined, job(name), tenant("one"));
          waits.push(performance.now() - started);
          assert.equal(permit.probe, true);
          await permit.settle({ error: serverError(503) });
          return (await flow.status()).breaker.cooldown_ms;
        };
        assert.deepEqual(
          [await probeBy("p1"), await probeBy("p2"), await probeBy("p3"), await probeBy("p4"), await probeBy("p5")],
          [200, 400, 800, 800, 800],
        );
        // One of the jobs that failed already probes (no fresh job asks): its failure proves nothing new.
        assert.equal(await probeBy("a"), 800);
        assert.ok(waits[0]! <= 250, `the first probe after ${waits[0]} ms`);
        await recover(flow, job("fresh"));
        assert.equal((await flow.status()).breaker.cooldown_ms, 100, "closed: the next opening starts short again");
      },
    );

    await t.step("a configured limit counts while its process lives, and no longer", async () => {
      await withdrawAll(); // the steps before configured LLM_RPM=60000 in every flow
      const configured = flowFor({ tpm: 60_000, configTtlMs: 1_500 });
      await (await configured.acquire(10)).settle(ok);
      const plain = flowFor({ rpm: undefined });
      const status = await plain.status();
      assert.equal(status.tpm.limit, 60_000, "another process's configuration counts while it lives");
      assert.equal(status.tpm.source, "config");
      assert.equal(status.configured_by.length, 1);
      // It stops and withdraws its configuration: at once, nothing configures the limit.
      await configured.withdraw();
      await (await plain.acquire(10)).settle(ok);
      assert.equal((await plain.status()).tpm.limit, null);
      // A process killed cannot withdraw: its entry expires.
      const killed = flowFor({ rpm: 600, configTtlMs: 1_000 });
      await (await killed.acquire(10)).settle(ok);
      assert.equal((await plain.status()).rpm.limit, 600);
      await sleep(1_100);
      await (await plain.acquire(10)).settle(ok);
      assert.equal((await plain.status()).rpm.limit, null, "expired within its TTL");
      // A process's own configuration binds it whatever the others say.
      const own = flowFor({ rpm: 60, configTtlMs: 1_000 });
      const first = await own.acquire(10);
      const second = await own.acquire(10);
      assert.ok(second.waitedMs >= 900, `paced at 60 a minute: waited ${second.waitedMs} ms`);
      await first.settle(ok);
      await second.settle(ok);
      await own.withdraw();
    });

    await t.step("a learned limit ends when the provider stops reporting it", async () => {
      const flow = flowFor({ rpm: undefined });
      await (await flow.acquire(10)).settle({ value: { text: "ok", headers: limitHeaders(600, 60_000) } });
      let status = await flow.status();
      assert.equal(status.tpm.limit, 60_000);
      assert.equal(status.tpm.source, "headers");
      assert.ok(status.headers.at !== null);
      // A success whose answer has headers but no limits: the provider no longer reports them.
      await (await flow.acquire(10)).settle({ value: { text: "ok", headers: new Headers({ "x-request-id": "r" }) } });
      status = await flow.status();
      assert.deepEqual([status.rpm.limit, status.tpm.limit], [null, null]);
      assert.ok(status.headers.stopped_at !== null);
      assert.equal(status.learning, false, "it answered: nothing left to learn");
      // A completion that carries no headers at all (not an HTTP provider) says nothing either way.
      await (await flow.acquire(10)).settle({ value: { text: "ok", headers: limitHeaders(600, 60_000) } });
      await (await flow.acquire(10)).settle(ok);
      assert.equal((await flow.status()).tpm.limit, 60_000);
      await (await flow.acquire(10)).settle({ value: { text: "ok", headers: new Headers() } });
    });

    await t.step("a limit of requests alone ends too when the provider stops reporting it", async () => {
      const flow = flowFor({ rpm: undefined });
      const requestsOnly = new Headers({ "x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "99" });
      await (await flow.acquire(10)).settle({ value: { text: "ok", headers: requestsOnly } });
      assert.equal((await flow.status()).rpm.limit, 100);
      await (await flow.acquire(10)).settle({ value: { text: "ok", headers: new Headers({ "x-request-id": "r" }) } });
      assert.equal((await flow.status()).rpm.limit, null);
    });

    await t.step(
      "in a 503 outage with no fresh job, the failed jobs' probes are absorbed and the wait still grows",
      async () => {
        const flow = flowFor();
        const { job, tenant } = ids();
        for (const name of ["a", "b", "c"]) await call(flow, job(name), tenant("one"), { error: serverError(503) });
        const verdicts = [];
        const waits = [];
        for (const name of ["a", "b", "c"]) {
          const permit = await flow.acquire(10, undefined, job(name), tenant("one"));
          assert.equal(permit.probe, true);
          verdicts.push(await permit.settle({ error: serverError(503) }));
          waits.push((await flow.status()).breaker.cooldown_ms);
        }
        assert.deepEqual(verdicts, [true, true, true], "no attempt spent: a 503 is nobody's document");
        assert.deepEqual(waits, [200, 400, 800]);
        await recover(flow, job("fresh"));
      },
    );

    await t.step(
      "a call granted before the breaker opened neither holds off the first probe nor closes it",
      async () => {
        const flow = flowFor();
        const { job, tenant } = ids();
        // Three calls under way while all is well; two fail, and the provider is suspect: its single call goes to
        // a fresh job, still running when the third call's failure opens the breaker.
        const [a, b, c] = await Promise.all(["a", "b", "c"].map((name) => flow.acquire(10, undefined, job(name))));
        await a!.settle({ error: serverError(503) });
        await b!.settle({ error: serverError(503) });
        const single = await flow.acquire(10, undefined, job("slow"), tenant("one"));
        assert.equal(single.probe, true);
        await c!.settle({ error: serverError(503) });
        assert.equal((await flow.status()).breaker.state, "open");
        const started = performance.now();
        const probe = await flow.acquire(10, undefined, job("fresh"), tenant("one"));
        assert.equal(probe.probe, true);
        assert.ok(performance.now() - started < 400, "the first probe is not held off by the earlier call");
        await single.settle(ok);
        assert.notEqual((await flow.status()).breaker.state, "closed", "the earlier call's success closes nothing");
        await probe.settle(ok);
        assert.equal((await flow.status()).breaker.state, "closed");
      },
    );

    await t.step(
      "a provider hanging on every call, one call at a time, opens after 3 jobs of 2 tenants (fewer than 5 calls)",
      async () => {
        // Its own provider: a window with no success in it, as after a long quiet spell.
        const flow = flowFor({
          key: providerStateKey(r.prefix, { baseURL: "http://hanging", model: "m", apiKey: "k" }),
        });
        const { job, tenant } = ids();
        const verdicts = [];
        for (const [name, who] of [["a", "x"], ["b", "y"], ["c", "x"]]) {
          verdicts.push(await call(flow, job(name!), tenant(who!), { error: new AttemptTimeout("scripted") }));
        }
        assert.deepEqual(verdicts, [false, false, false]);
        const status = await flow.status();
        assert.equal(status.breaker.state, "open", `failing share ${status.breaker.failing_share}`);
        assert.equal(status.breaker.reason, "failure_rate");
        await recover(flow, job("fresh"));
      },
    );

    await t.step("a worker's configuration stays live while it makes no call, and goes when it stops", async () => {
      await withdrawAll();
      const quiet = flowFor({ rpm: 120, configTtlMs: 600, keepAlive: true });
      await (await quiet.acquire(10)).settle(ok);
      const reader = flowFor({ rpm: undefined });
      await sleep(1_500); // more than twice its TTL without a call
      assert.equal((await reader.status()).rpm.limit, 120, "said again from its timer");
      await quiet.withdraw();
      assert.equal((await reader.status()).rpm.limit, null);
    });

    await t.step("every flow withdrawn, the shared state holds no limit and a closed breaker", async () => {
      await withdrawAll();
      const status = await flowFor({ rpm: undefined }).status();
      assert.equal(status.breaker.state, "closed");
      assert.deepEqual([status.rpm.limit, status.tpm.limit], [null, null]);
      assert.deepEqual(status.configured_by, []);
    });
  } finally {
    for (const flow of flows) await flow.settled();
    await r.close();
  }
});
