/**
 * The router's read gate (`capacity()` of `src/provider/deployments.ts`): the worker reads as many jobs as it
 * answers. The rule, as the code has it: the models a call asked for within the last 10 s count (every model the
 * router serves while none has been asked for), each such model's flow on each deployment serving it adds the
 * permits its gate has within about a second (a paused flow none, a broken one none until its probe is due), and
 * the callers in `acquire()` without a permit or a booked slot are taken off (one a flow booked a slot for is
 * already left out by that flow's gate). A total of 0 or less answers `{ permits: 0, waitMs }`: the
 * shortest wait its flows named, 50 ms for a flow that named none, at least 50 ms.
 *
 * Every flow is real, in one Redis under a scratch prefix, with a configured limit and nothing else booked, so
 * its gate's permits are exact: `floor(1000 ms / interval) + 1` at an interval of `60000 / (rpm * FLOW_DEFAULTS.margin)` ms.
 * No model is ever called: a call's permit is settled as aborted, which says nothing about the provider.
 */
import assert from "node:assert/strict";
import { APIError } from "openai";
import type { Models } from "../../src/llm/models.ts";
import { fromOpenAiError } from "../../src/llm/openai_errors.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createRouter, type RoutedDeployment } from "../../src/provider/deployments.ts";
import { createProviderFlow, type ProviderFlow, providerStateKey } from "../../src/provider/flow_control.ts";
import { createTestRedis, type TestRedis, waitFor } from "../_support.ts";

/** The permits a flow's gate has with nothing booked, by its configured requests per minute. */
const PERMITS = { 600: 10, 1200: 20, 3000: 48, 100_000: 1584 } as const;
type Rpm = keyof typeof PERMITS;

/** An error as the OpenAI SDK raises it for an HTTP answer. */
function apiError(status: number, code: string, headers: Record<string, string> = {}) {
  const body = { message: `scripted ${status}`, type: code, param: null, code };
  return fromOpenAiError(APIError.generate(status, { error: body }, body.message, new Headers(headers)));
}

let generation = 0;

/**
 * A router over `spec`: deployment name -> model -> its configured rpm, each model of each deployment under a
 * flow of its own (fresh state: the key names a new API key). `flow(deployment, model)` hands one back.
 */
function routerOf(r: TestRedis, spec: Record<string, Record<string, Rpm>>, defaultModel = "A") {
  generation++;
  const flows = new Map<string, ProviderFlow>();
  const deployments: RoutedDeployment[] = Object.entries(spec).map(([name, served]) => {
    const baseURL = `http://${name}.invalid/v1`;
    const apiKey = `sk-${name}-${generation}`;
    const own = new Map(
      Object.entries(served).map(([model, rpm]) => {
        const flow = createProviderFlow({ redis: r.redis, log: silentLogger }, {
          key: providerStateKey(r.prefix, { baseURL, model, apiKey }),
          rpm,
          cooldownMs: 30_000,
          probeLeaseMs: 5_000,
        });
        flows.set(`${name}/${model}`, flow);
        return [model, flow] as const;
      }),
    );
    const llm = createOpenAiLlm({ apiKey, model: Object.keys(served)[0]!, baseURL });
    return { name, weight: 1, llm, flows: own };
  });
  const models = createRouter({ deployments, defaultModel, fallbackAfterMs: 10_000, random: () => 0 });
  return { models, flow: (deployment: string, model: string) => flows.get(`${deployment}/${model}`)! };
}

/** Waits until no slot of `flow` is booked ahead (its permits are whole again). */
async function slotsPassed(flow: ProviderFlow): Promise<void> {
  await waitFor("the booked slots to pass", async () => {
    const status = await flow.status();
    return status.next_permit_at <= status.now;
  });
}

/** One call asking for `asked` (a task's list): takes its permit, reports it aborted, waits for its slots to pass. */
async function call(models: Models, asked: string[], flow: (deployment: string, model: string) => ProviderFlow) {
  const got = await models.acquire(asked, 100, { jobId: crypto.randomUUID(), tenant: "acme" });
  await got.permit!.settle({ aborted: true });
  const used = flow(got.deployment, got.model);
  await used.settled();
  await slotsPassed(used);
  return got;
}

/** Pauses `flow` for `seconds` as a 429 rate_limit_exceeded with that retry-after does. */
async function pause(flow: ProviderFlow, seconds: number) {
  const permit = await flow.acquire(1);
  await permit.settle({ error: apiError(429, "rate_limit_exceeded", { "retry-after": String(seconds) }) });
  assert.ok((await flow.status()).pause.until !== null, "paused");
}

/** Opens `flow`'s breaker, as an exhausted quota does. */
async function breakOpen(flow: ProviderFlow) {
  const permit = await flow.acquire(1);
  await permit.settle({ error: apiError(429, "insufficient_quota") });
  assert.equal((await flow.status()).breaker.state, "open");
}

Deno.test("the router's read gate: the models asked for lately, less the callers waiting", async (t) => {
  const r = await createTestRedis();
  try {
    await t.step("no call asked yet: every model of every deployment counts", async () => {
      // east serves A and B, west A and C: three models, four flows.
      const { models, flow } = routerOf(r, { east: { A: 600, B: 100_000 }, west: { A: 1200, C: 3000 } });
      // Each flow's own gate, as the router adds them up.
      for (const [key, rpm] of [["east/A", 600], ["east/B", 100_000], ["west/A", 1200], ["west/C", 3000]] as const) {
        const [deployment, model] = key.split("/") as [string, string];
        assert.deepEqual(await flow(deployment, model).ready(), { permits: PERMITS[rpm], waitMs: 0 }, key);
      }
      assert.deepEqual(await models.capacity!(500), { permits: 10 + 1584 + 20 + 48, waitMs: 0 });
    });

    await t.step("calls asked for A only: A's deployments count, B's much larger limit and C do not", async () => {
      const { models, flow } = routerOf(r, { east: { A: 600, B: 100_000 }, west: { A: 1200, C: 3000 } });
      const got = await call(models, ["A"], flow);
      assert.equal(got.model, "A");
      // A on east (10) and on west (20); not B on east, a flow of the same deployment, nor C.
      assert.deepEqual(await models.capacity!(500), { permits: 10 + 20, waitMs: 0 });
      // A second call for A changes nothing: a model counts once, however many calls asked for it.
      await call(models, ["A"], flow);
      assert.deepEqual(await models.capacity!(500), { permits: 10 + 20, waitMs: 0 });
    });

    await t.step("calls for A and for B within the window: the sum of their deployments", async () => {
      const { models, flow } = routerOf(r, { east: { A: 600, B: 100_000 }, west: { A: 1200, C: 3000 } });
      await call(models, ["A"], flow);
      await call(models, ["B"], flow);
      assert.deepEqual(await models.capacity!(500), { permits: 10 + 20 + 1584, waitMs: 0 });
      // (Past the 10 s window B would drop out; the router reads performance.now() and its window is a constant,
      // so that is not checked here.)
    });

    await t.step("a call counts every model its task lists, served or not; one naming none, the default", async () => {
      const listed = routerOf(r, { east: { A: 600, B: 100_000 }, west: { A: 1200, C: 3000 } });
      const got = await call(listed.models, ["A", "B"], listed.flow);
      assert.equal(got.model, "A", "served by its first model");
      assert.deepEqual(await listed.models.capacity!(500), { permits: 10 + 20 + 1584, waitMs: 0 });
      const summary = routerOf(r, { east: { A: 600, B: 100_000 }, west: { A: 1200, C: 3000 } }, "C");
      assert.equal((await call(summary.models, [], summary.flow)).model, "C");
      assert.deepEqual(await summary.models.capacity!(500), { permits: 48, waitMs: 0 });
    });

    await t.step("callers waiting in acquire() are taken off; more than the permits: none, and a wait", async () => {
      // A's only deployment is paused (a 429 asking for 30 s): calls for A wait in acquire().
      const { models, flow } = routerOf(r, { east: { A: 600 }, west: { B: 1200 } });
      await pause(flow("east", "A"), 30);
      await call(models, ["B"], flow);
      const stop = new AbortController();
      const wait = (n: number) =>
        Array.from(
          { length: n },
          () => models.acquire(["A"], 100, { signal: stop.signal, jobId: crypto.randomUUID() }),
        );
      // A caller counts once it has been refused and waits to ask again (a Redis round trip after it asked).
      const capacityIs = (expected: { permits: number; waitMs: number }) =>
        waitFor(`capacity ${JSON.stringify(expected)}`, async () => {
          const got = await models.capacity!(500);
          return got.permits === expected.permits && got.waitMs === expected.waitMs;
        });
      const three = wait(3);
      // A paused counts 0, B 20, less the three callers.
      await capacityIs({ permits: 20 - 3, waitMs: 0 });
      const more = wait(22);
      // 25 callers for 20 permits: none, asked again after the shortest wait a flow named (B's 0 counts as 50 ms).
      await capacityIs({ permits: 0, waitMs: 50 });
      stop.abort();
      for (const waiter of [...three, ...more]) await assert.rejects(waiter);
      // They stopped waiting: B's whole 20 again.
      assert.deepEqual(await models.capacity!(500), { permits: 20, waitMs: 0 });
    });

    await t.step("a caller with a slot booked ahead is not taken off twice: the gate is its flow's", async () => {
      // One deployment at 600 rpm (a slot every 105 ms): three calls at once, the first goes at once and the
      // other two sleep in the flow until their booked slots. The flow's own gate already leaves their slots out;
      // the router counted them again as waiting (6 against the flow's 8), so the worker read fewer jobs than the
      // flow allowed while calls were paced.
      const { models, flow } = routerOf(r, { east: { A: 600 } });
      await call(models, ["A"], flow);
      const calls = Array.from({ length: 3 }, () => models.acquire(["A"], 100, { jobId: crypto.randomUUID() }));
      await waitFor("three slots booked", async () => (await flow("east", "A").ready()).permits <= PERMITS[600] - 3);
      // Their replies read (the callers told of their slots), the last slot still about 200 ms ahead.
      await new Promise((resolve) => setTimeout(resolve, 20));
      const own = await flow("east", "A").ready();
      assert.ok(own.permits <= PERMITS[600] - 2, `slots still booked ahead (the flow's gate: ${own.permits})`);
      assert.deepEqual(await models.capacity!(500), own);
      for (const got of await Promise.all(calls)) await got.permit!.settle({ aborted: true });
      await flow("east", "A").settled();
    });

    await t.step("a paused deployment and a broken one count nothing", async () => {
      const { models, flow } = routerOf(r, { east: { A: 600 }, west: { A: 1200 }, north: { A: 3000 } });
      await call(models, ["A"], flow);
      assert.deepEqual(await models.capacity!(500), { permits: 10 + 20 + 48, waitMs: 0 });
      // A pause shorter than LLM_FALLBACK_AFTER_S (2 s of 10 s): the model is still available, west counts 0.
      await pause(flow("west", "A"), 2);
      assert.deepEqual(await models.capacity!(500), { permits: 10 + 48, waitMs: 0 });
      // north out of quota: its breaker open, it counts 0 too (until its first probe is due, 1 s on, when its
      // half-open flow counts the probe's 1).
      await breakOpen(flow("north", "A"));
      assert.deepEqual(await models.capacity!(500), { permits: 10, waitMs: 0 });
      // Every deployment of A paused or broken: none, and a wait until the soonest of them may take calls.
      await pause(flow("east", "A"), 30);
      const { permits, waitMs } = await models.capacity!(500);
      assert.equal(permits, 0);
      assert.ok(waitMs > 50 && waitMs <= 2_000, `the wait is west's pause left (got ${waitMs} ms)`);
    });
  } finally {
    await r.close();
  }
});
