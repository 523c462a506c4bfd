/**
 * The typed client against the real API over HTTP: tasks, summaries and
 * runs through a real worker, idempotent retries (the same key after a lost
 * response is a replay, one job), Retry-After honoured through a proxy that
 * refuses the first requests, no retry of other 4xx, and webhooks signed by
 * the real relay verified with the client's `verifyWebhook`.
 */
import assert from "node:assert/strict";
import {
  createClient,
  OncelyError,
  type RunEvent,
  type TaskDefinition,
  verifyWebhook,
  WebhookVerificationError,
} from "../../src/client/client.ts";
import { signWebhook } from "../../src/webhooks/signature.ts";
import { waitFor } from "../_support.ts";
import { serveTestApi, startProxy, STRUCTURED_ANSWER } from "./_served_api.ts";

const TEXT = "Revenue rose 12% in Q3. Costs fell. The board approved the plan. Staff were told on Friday.";

const TICKET: TaskDefinition = {
  system: "You sort support tickets.",
  prompt: "Classify this ticket from {{input.customer.name}}:\n\n{{input.body}}",
  input_schema: {
    type: "object",
    properties: {
      body: { type: "string", maxLength: 20_000 },
      customer: { type: "object", properties: { name: { type: "string" } } },
    },
    required: ["body"],
  },
  output_schema: {
    type: "object",
    properties: { category: { enum: ["billing", "bug", "other"] }, urgent: { type: "boolean" } },
    required: ["category", "urgent"],
    additionalProperties: false,
  },
  max_output_tokens: 200,
};

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;

/** A fetch that counts the requests it sends. */
function countingFetch() {
  const seen: { method: string; url: string; headers: Headers }[] = [];
  const counted: typeof fetch = (input, init) => {
    seen.push({ method: init?.method ?? "GET", url: String(input), headers: new Headers(init?.headers) });
    return fetch(input, init);
  };
  return { seen, fetch: counted };
}

function problemResponse(status: number, title: string, headers: Record<string, string>, extra = {}) {
  return new Response(JSON.stringify({ type: "about:blank", title, status, detail: `scripted ${status}`, ...extra }), {
    status,
    headers: { ...headers, "content-type": "application/problem+json" },
  });
}

Deno.test("the client against the real API", async (t) => {
  const api = await serveTestApi();
  const oncely = createClient({ baseUrl: api.url, apiKey: api.apiKey });
  const effects = async (jobId: string) => {
    const [row] = await api.db.sql<{ s: number; o: number }[]>`
      SELECT (SELECT count(*) FROM summaries WHERE job_id = ${jobId}::uuid)::int AS s,
        (SELECT count(*) FROM outbox WHERE payload->>'job_id' = ${jobId})::int AS o`;
    return { summaries: row!.s, outbox: row!.o };
  };
  const promptsFor = (text: string) => api.prompts.filter((p) => p.includes(text)).length;
  let doneRunId = "";
  try {
    await t.step(
      "putTask: 201 with version 1, 200 with version 1 for the same body, 201 with 2 on a change",
      async () => {
        const first = await oncely.putTask("ticket", TICKET);
        assert.equal(first.status, 201);
        assert.equal(first.task.name, "ticket");
        assert.equal(first.task.version, 1);
        assert.equal(first.task.prompt, TICKET.prompt);
        assert.ok(Date.parse(first.task.created_at!) > 0);
        const again = await oncely.putTask("ticket", TICKET);
        assert.equal(again.status, 200);
        assert.equal(again.task.version, 1);
        const changed = await oncely.putTask("ticket", { ...TICKET, temperature: 0 });
        assert.equal(changed.status, 201);
        assert.equal(changed.task.version, 2);
        const rows = await api.db.sql`SELECT version FROM tasks WHERE tenant = 'acme' AND name = 'ticket'`;
        assert.equal(rows.length, 2, "two stored versions");
      },
    );

    await t.step(
      "getTask reads the latest or a given version; listTasks lists summarize, then the tenant's",
      async () => {
        assert.equal((await oncely.getTask("ticket")).version, 2);
        const v1 = await oncely.getTask("ticket", 1);
        assert.equal(v1.version, 1);
        assert.equal(v1.temperature, undefined);
        assert.equal((await oncely.getTask("summarize")).built_in, true);
        const tasks = await oncely.listTasks();
        assert.deepEqual(tasks.map((task) => [task.name, task.version]), [["summarize", 1], ["ticket", 2]]);
      },
    );

    await t.step("errors are OncelyErrors with the problem document; a 422 or 404 is sent once", async () => {
      const counting = countingFetch();
      const client = createClient({ baseUrl: api.url, apiKey: api.apiKey, fetch: counting.fetch });
      const error = await client.putTask("bad", { ...TICKET, prompt: "Hi {{input.nobody}}" }).catch((e) => e);
      assert.ok(error instanceof OncelyError);
      assert.equal(error.status, 422);
      assert.equal(error.problem.status, 422);
      assert.equal(error.problem.title, "Unprocessable Content");
      assert.equal(error.problem.errors?.[0]?.pointer, "/prompt");
      assert.match(error.message, /422.*\/prompt/);
      const missing = await client.getTask("nobody").catch((e) => e);
      assert.ok(missing instanceof OncelyError);
      assert.equal(missing.status, 404);
      const badNotify = await client.summarize({ text: TEXT, notify: "not an address" }).catch((e) => e);
      assert.ok(badNotify instanceof OncelyError);
      assert.equal(badNotify.status, 422);
      assert.equal(badNotify.problem.errors?.[0]?.path, "notify");
      assert.equal(counting.seen.length, 3, "one request each");
      assert.equal((await api.db.sql`SELECT 1 FROM tasks WHERE name = 'bad'`).length, 0);
      await assert.rejects(client.getRun(crypto.randomUUID(), { waitS: 61 }), RangeError);
    });

    await t.step("summarize, waitForRun through a real worker, getRun; with waitS the POST answers done", async () => {
      const worker = api.startWorker();
      try {
        const submitted = await oncely.summarize({ text: TEXT, notify: "ops@example.com" });
        assert.equal(submitted.status, 202);
        assert.equal(submitted.replayed, false);
        assert.match(submitted.job.job_id, UUID);
        assert.match(submitted.idempotencyKey, UUID, "a generated key");
        const run = await oncely.waitForRun<string>(submitted.job.job_id, { timeoutS: 30 });
        assert.equal(run.status, "done");
        assert.equal(run.task, "summarize");
        assert.equal(typeof run.output, "string");
        assert.ok(run.output!.length > 0);
        // Attempts are recorded within a second of the call, so the finished run may not count its own yet.
        const read = await waitFor("its model call recorded", async () => {
          const now = await oncely.getRun<string>(run.run_id);
          return now.attempts >= 1 && now;
        });
        assert.deepEqual({ ...read, attempts: 0 }, { ...run, attempts: 0 });
        doneRunId = run.run_id;

        const text = `${TEXT} A waited one.`;
        const waited = await oncely.summarize({ text, notify: "ops@example.com", waitS: 20 });
        assert.equal(waited.status, 200);
        assert.equal(waited.job.status, "done");
        assert.equal(typeof (waited.status === 200 && waited.job.summary), "string");
        assert.deepEqual(await effects(waited.job.job_id), { summaries: 1, outbox: 1 });
        assert.equal(promptsFor("A waited one."), 1);
      } finally {
        await worker.stop();
      }
    });

    await t.step("a response lost after the server acted is retried with the same key: a replay, one job", async () => {
      const keys: string[] = [];
      let firstJobId = "";
      const dropFirst: typeof fetch = async (input, init) => {
        const headers = new Headers(init?.headers);
        const key = headers.get("idempotency-key");
        if (key) keys.push(key);
        const res = await fetch(input, init);
        if (keys.length === 1 && key) {
          // The server has queued the job; the client never hears of it.
          firstJobId = (await res.json()).job_id;
          throw new TypeError("error sending request: connection reset by peer");
        }
        return res;
      };
      const client = createClient({ baseUrl: api.url, apiKey: api.apiKey, fetch: dropFirst, retryBaseMs: 10 });
      const text = `${TEXT} Sent twice, done once.`;
      const submitted = await client.summarize({ text, notify: "ops@example.com" });
      assert.equal(keys.length, 2);
      assert.equal(keys[0], keys[1], "the same Idempotency-Key on the retry");
      assert.equal(submitted.idempotencyKey, keys[0]);
      assert.equal(submitted.replayed, true);
      assert.equal(submitted.job.job_id, firstJobId);
      const worker = api.startWorker();
      try {
        assert.equal((await oncely.waitForRun(firstJobId, { timeoutS: 30 })).status, "done");
      } finally {
        await worker.stop();
      }
      assert.deepEqual(await effects(firstJobId), { summaries: 1, outbox: 1 });
      assert.equal(promptsFor("Sent twice, done once."), 1, "one model call");
    });

    await t.step(
      "503 and 429 with Retry-After (seconds, HTTP date) and an in-progress 409 are waited out",
      async () => {
        const proxy = startProxy(api.url, (n) => {
          if (n === 1) return problemResponse(503, "Service Unavailable", { "retry-after": "1" });
          if (n === 2) {
            const date = new Date(Date.now() + 2_000).toUTCString();
            return problemResponse(429, "Too Many Requests", { "retry-after": date });
          }
          if (n === 3) return problemResponse(409, "Conflict", { "retry-after": "0" });
        });
        try {
          const client = createClient({ baseUrl: proxy.url, apiKey: api.apiKey });
          const submitted = await client.summarize({ text: `${TEXT} Through a proxy.`, notify: "ops@example.com" });
          assert.equal(submitted.status, 202);
          assert.equal(submitted.replayed, false, "the refused tries never reached the API");
          const [a, b, c, d] = proxy.requests;
          assert.equal(proxy.requests.length, 4);
          assert.ok(b!.at - a!.at >= 950, `Retry-After: 1 waited out (${b!.at - a!.at} ms)`);
          assert.ok(c!.at - b!.at >= 950, `the HTTP date waited out (${c!.at - b!.at} ms)`);
          assert.ok(d!.at >= c!.at);
          const sent = proxy.requests.map((r) => r.headers.get("idempotency-key"));
          assert.deepEqual(sent, Array(4).fill(submitted.idempotencyKey), "one key on every try");
          assert.deepEqual(await effects(submitted.job.job_id), { summaries: 0, outbox: 0 });
          await oncely.cancelRun(submitted.job.job_id);
        } finally {
          await proxy.close();
        }
      },
    );

    await t.step(
      "a Retry-After longer than maxRetryAfterS is the caller's: thrown at once, with its seconds",
      async () => {
        const proxy = startProxy(
          api.url,
          () =>
            problemResponse(429, "Budget exhausted", { "retry-after": "3600" }, {
              budget: { period: "day", limit: 5, spent: 5, unit: "usd" },
            }),
        );
        try {
          const client = createClient({ baseUrl: proxy.url, apiKey: api.apiKey });
          const error = await client.summarize({ text: TEXT, notify: "ops@example.com" }).catch((e) => e);
          assert.ok(error instanceof OncelyError);
          assert.equal(error.status, 429);
          assert.equal(error.retryAfterS, 3600);
          assert.equal(error.problem.title, "Budget exhausted");
          assert.deepEqual(error.problem.budget, { period: "day", limit: 5, spent: 5, unit: "usd" });
          assert.equal(proxy.requests.length, 1);
        } finally {
          await proxy.close();
        }
      },
    );

    await t.step(
      "without Retry-After, 5xx back off exponentially with full jitter, capped, maxRetries times",
      async () => {
        const proxy = startProxy(api.url, () => new Response("upstream down", { status: 502 }));
        try {
          const sleeps: number[] = [];
          const client = createClient({
            baseUrl: proxy.url,
            apiKey: api.apiKey,
            maxRetries: 3,
            retryBaseMs: 100,
            retryCapMs: 300,
            random: () => 0.5,
            sleep: (ms) => {
              sleeps.push(ms);
              return Promise.resolve();
            },
          });
          const error = await client.listTasks().catch((e) => e);
          assert.ok(error instanceof OncelyError);
          assert.equal(error.status, 502);
          assert.equal(error.problem.detail, "upstream down", "a body that is no problem document is kept as detail");
          assert.deepEqual(sleeps, [50, 100, 150], "half of 100, 200, then the 300 cap");
          assert.equal(proxy.requests.length, 4, "the first try and 3 retries");
        } finally {
          await proxy.close();
        }
      },
    );

    await t.step("an abort ends a wait between retries at once", async () => {
      const proxy = startProxy(api.url, () => problemResponse(503, "Service Unavailable", { "retry-after": "30" }));
      try {
        const client = createClient({ baseUrl: proxy.url, apiKey: api.apiKey });
        const error = await client.listTasks({ signal: AbortSignal.timeout(200) }).catch((e) => e);
        assert.ok(error instanceof DOMException);
        assert.equal(error.name, "TimeoutError");
        assert.equal(proxy.requests.length, 1);
      } finally {
        await proxy.close();
      }
    });

    await t.step("cancelRun cancels a queued run, again too; a finished run is a 409, sent once", async () => {
      const counting = countingFetch();
      const client = createClient({ baseUrl: api.url, apiKey: api.apiKey, fetch: counting.fetch });
      const { job } = await client.summarize({ text: `${TEXT} Cancelled.`, notify: "ops@example.com" });
      assert.equal((await client.cancelRun(job.job_id)).status, "cancelled");
      assert.equal((await client.cancelRun(job.job_id)).status, "cancelled");
      const before = counting.seen.length;
      const error = await client.cancelRun(doneRunId).catch((e) => e);
      assert.ok(error instanceof OncelyError);
      assert.equal(error.status, 409);
      assert.equal(counting.seen.length, before + 1);
      assert.equal((await client.waitForRun(job.job_id)).status, "cancelled", "a cancelled run is finished");
    });

    await t.step("waitForRun gives up after timeoutS with a TimeoutError", async () => {
      const { job } = await oncely.summarize({ text: `${TEXT} Never run.`, notify: "ops@example.com" });
      const error = await oncely.waitForRun(job.job_id, { timeoutS: 1 }).catch((e) => e);
      assert.ok(error instanceof DOMException);
      assert.equal(error.name, "TimeoutError");
      await oncely.cancelRun(job.job_id);
    });

    await t.step("a webhook sent by the real relay verifies with verifyWebhook", async () => {
      const deliveries: { headers: Headers; body: string; verified: unknown }[] = [];
      const receiver = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
        const body = await req.text();
        const verified = await verifyWebhook({ secret: api.secret, headers: req.headers, body }).catch((e) => e);
        deliveries.push({ headers: req.headers, body, verified });
        return new Response(null, { status: verified instanceof Error ? 401 : 204 });
      });
      const worker = api.startWorker();
      try {
        const url = `http://127.0.0.1:${receiver.addr.port}/hooks`;
        const submitted = await oncely.summarize({ text: `${TEXT} By webhook.`, notify: { webhook: url }, waitS: 20 });
        assert.equal(submitted.status, 200, "done within the wait");
        const job = submitted.job;
        await waitFor("the webhook delivered", async () => {
          await api.relay.runOnce();
          return deliveries.length > 0;
        }, 10_000);
        const [delivery] = deliveries;
        assert.deepEqual(delivery!.verified, {
          type: "summary.ready",
          job_id: job.job_id,
          status: "done",
          summary: submitted.status === 200 ? submitted.job.summary : undefined,
        });
        const { headers, body } = delivery!;
        const timestamp = Number(headers.get("webhook-timestamp")) * 1000;
        const refused = (options: Partial<Parameters<typeof verifyWebhook>[0]>, says: RegExp) =>
          assert.rejects(verifyWebhook({ secret: api.secret, headers, body, ...options }), (error: Error) => {
            assert.ok(error instanceof WebhookVerificationError, String(error));
            assert.match(error.message, says);
            return true;
          });
        await refused({ body: body.replace("done", "dona") }, /matches none/);
        await refused({ secret: `whsec_${btoa("another secret, 24 bytes!")}` }, /matches none/);
        await refused({ now: timestamp + 301_000 }, /past, over the 300 s tolerance/);
        await refused({ now: timestamp - 301_000 }, /future/);
        await refused({ now: timestamp + 11_000, toleranceS: 10 }, /tolerance/);
        await refused({ headers: new Headers({ "webhook-id": "x", "webhook-timestamp": "1" }) }, /signature header/);
        // Node's req.headers shape, a byte body, and a rotation's two secrets all verify.
        const nodeHeaders = Object.fromEntries(headers);
        const bytes = new TextEncoder().encode(body);
        const secrets = [`whsec_${btoa("the old secret, 24 bytes")}`, api.secret];
        assert.equal(
          (await verifyWebhook<{ job_id: string }>({ secrets, headers: nodeHeaders, body: bytes })).job_id,
          job.job_id,
        );
      } finally {
        await worker.stop();
        await receiver.shutdown();
      }
    });

    await t.step("verifyWebhook accepts any of several signatures, as the server signs during a rotation", async () => {
      const [old, current] = [`whsec_${btoa("old secret of 24 bytes!!")}`, `whsec_${btoa("new secret of 24 bytes!!")}`];
      const body = JSON.stringify({ type: "run.completed", run_id: crypto.randomUUID(), status: "done" });
      const id = "run_completed:1";
      const timestamp = Math.floor(Date.now() / 1000);
      const signature = await signWebhook({ id, timestamp, body, secrets: [old, current] });
      assert.equal(signature.split(" ").length, 2);
      const headers = { "webhook-id": id, "webhook-timestamp": String(timestamp), "webhook-signature": signature };
      for (const secret of [old, current]) {
        assert.deepEqual(await verifyWebhook({ secret, headers, body }), JSON.parse(body));
      }
      await assert.rejects(verifyWebhook({ secret: "whsec_not base64!", headers, body }), TypeError);
      await assert.rejects(verifyWebhook({ headers, body }), TypeError);
    });
  } finally {
    await api.close();
  }
});

Deno.test({
  name: "startRun runs a task with an output schema, waits with waitS, and replays its key",
  async fn() {
    const api = await serveTestApi();
    const oncely = createClient({ baseUrl: api.url, apiKey: api.apiKey });
    const worker = api.startWorker();
    try {
      await oncely.putTask("ticket", TICKET);
      const input = { body: "The app crashes on start.", customer: { name: "Ann" } };
      const started = await oncely.startRun<typeof STRUCTURED_ANSWER>("ticket", { input, waitS: 20 });
      assert.equal(started.status, 200);
      assert.equal(started.replayed, false);
      assert.match(started.idempotencyKey, UUID);
      if (started.status !== 200) throw new Error("unreachable");
      assert.equal(started.run.status, "done");
      assert.equal(started.run.task, "ticket");
      assert.equal(started.run.version, 1);
      assert.deepEqual(started.run.output, STRUCTURED_ANSWER);
      assert.deepEqual(await oncely.getRun(started.run.run_id), started.run);

      const again = await oncely.startRun("ticket", { input, idempotencyKey: started.idempotencyKey });
      assert.equal(again.replayed, true);
      assert.equal(again.run.run_id, started.run.run_id);

      const queued = await oncely.startRun("ticket", { input: { body: "Refund please." }, version: 1 });
      assert.equal(queued.status, 202);
      assert.equal((await oncely.waitForRun(queued.run.run_id, { timeoutS: 30 })).status, "done");
      assert.equal(api.prompts.filter((p) => p.startsWith("Classify this ticket")).length, 2, "two model calls");

      const refused = await oncely.startRun("ticket", { input: { customer: { name: 1 } } }).catch((e) => e);
      assert.ok(refused instanceof OncelyError);
      assert.equal(refused.status, 422);
      assert.ok(refused.problem.errors?.[0]?.pointer !== undefined, JSON.stringify(refused.problem));

      // usage(): the tenant's own calls, by task; the two runs' calls are there (recorded within a second).
      let usage = await oncely.usage({ since: "1h" });
      for (let i = 0; i < 50 && (usage.by_task.find((t) => t.task === "ticket")?.calls ?? 0) < 2; i++) {
        await new Promise((resolve) => setTimeout(resolve, 100));
        usage = await oncely.usage({ since: "1h" });
      }
      assert.equal(usage.since, "1h");
      assert.equal(usage.by_task.find((t) => t.task === "ticket")?.calls, 2);
      assert.deepEqual(usage.budgets, []);
    } finally {
      await worker.stop();
      await api.close();
    }
  },
});

/** The payloads of a lane stream's entries, by job id, as intake wrote them. */
async function payloadsOn(api: Awaited<ReturnType<typeof serveTestApi>>, stream: string) {
  const entries = await api.redis.xrange(stream, "-", "+");
  return new Map(entries.map(([, flat]) => {
    const fields = Object.fromEntries(flat.flatMap((v, i) => (i % 2 ? [] : [[v, flat[i + 1]!]])));
    return [fields.job_id!, JSON.parse(fields.payload ?? "null") as Record<string, unknown>];
  }));
}

Deno.test({
  name: "startRun sends priority and expires_in; a run not started by its expiry is expired to the client",
  async fn() {
    const api = await serveTestApi();
    const oncely = createClient({ baseUrl: api.url, apiKey: api.apiKey });
    const deliveries: { body: string; event: RunEvent | Error }[] = [];
    const receiver = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
      const body = await req.text();
      const event = await verifyWebhook<RunEvent>({ secret: api.secret, headers: req.headers, body }).catch((e) => e);
      deliveries.push({ body, event });
      return new Response(null, { status: event instanceof Error ? 401 : 204 });
    });
    const lane = api.keys.lane("acme");
    let worker: { stop(): Promise<void> } | undefined;
    try {
      await oncely.putTask("ticket", TICKET);
      // No worker yet: both runs wait in the lane. The high one may wait 1 s, the low one 10 minutes.
      const before = Date.now();
      const urgent = await oncely.startRun("ticket", {
        input: { body: "Checkout is down, urgent." },
        priority: "high",
        expiresInS: 1,
        notify: { webhook: `http://127.0.0.1:${receiver.addr.port}/hooks` },
      });
      const afterUrgent = Date.now();
      const backlog = await oncely.startRun("ticket", {
        input: { body: "Nightly re-classification." },
        priority: "low",
        expiresInS: 600,
      });
      const afterBacklog = Date.now();
      assert.equal(urgent.status, 202);
      assert.equal(backlog.status, 202);
      const urgentId = urgent.run.run_id, backlogId = backlog.run.run_id;
      // Waiting on the urgent run from before its expiry: the outcome wakes the long poll.
      const waiting = oncely.waitForRun(urgentId, { timeoutS: 30 });

      // The POST body carried both fields: each run is on its priority's stream of the tenant's lane, its
      // payload names the priority and expires_at (acceptance + expires_in, epoch ms), its record the priority.
      const high = await payloadsOn(api, lane.streamOf("high"));
      const low = await payloadsOn(api, lane.streamOf("low"));
      assert.deepEqual([...high.keys()], [urgentId]);
      assert.deepEqual([...low.keys()], [backlogId]);
      const urgentPayload = high.get(urgentId)!, backlogPayload = low.get(backlogId)!;
      assert.equal(urgentPayload.priority, "high");
      assert.equal(backlogPayload.priority, "low");
      const urgentExpiresAt = urgentPayload.expires_at as number;
      const backlogExpiresAt = backlogPayload.expires_at as number;
      assert.ok(
        urgentExpiresAt >= before + 1_000 && urgentExpiresAt <= afterUrgent + 1_000,
        `expires_at ${urgentExpiresAt} is 1 s after acceptance (${before}..${afterUrgent})`,
      );
      assert.ok(backlogExpiresAt >= afterUrgent + 600_000 && backlogExpiresAt <= afterBacklog + 600_000);
      assert.equal(await api.redis.hget(lane.job(urgentId), "priority"), "high");
      assert.equal(await api.redis.hget(lane.job(backlogId), "priority"), "low");
      assert.equal((await oncely.getRun(urgentId)).status, "queued");

      // A worker that starts after the urgent run's expiry: it decides it expired and runs the low one.
      await new Promise((resolve) => setTimeout(resolve, Math.max(0, urgentExpiresAt + 50 - Date.now())));
      worker = api.startWorker();
      const expired = await waiting;
      assert.equal(expired.status, "expired");
      assert.equal(expired.run_id, urgentId);
      assert.equal(expired.task, "ticket");
      assert.equal(expired.version, 1);
      assert.equal(expired.output, undefined);
      assert.equal(expired.attempts, 0);
      assert.deepEqual(expired.tokens, { prompt: 0, completion: 0 });
      assert.deepEqual(await oncely.getRun(urgentId), expired);
      assert.equal((await oncely.waitForRun(backlogId, { timeoutS: 30 })).status, "done");
      assert.equal(api.prompts.filter((p) => p.includes("Checkout is down")).length, 0, "no model call");
      assert.equal(api.prompts.filter((p) => p.includes("Nightly re-classification")).length, 1);
      // Decided in Postgres with the expiry the run carried.
      const [row] = await api.db.sql<{ outcome: string; expires_at: Date }[]>`
        SELECT outcome, expires_at FROM job_outcomes WHERE job_id = ${urgentId}::uuid`;
      assert.equal(row?.outcome, "expired");
      assert.equal(row?.expires_at.getTime(), urgentExpiresAt);

      // expired is final: cancelling it is a 409, and it stays expired.
      const refused = await oncely.cancelRun(urgentId).catch((e) => e);
      assert.ok(refused instanceof OncelyError);
      assert.equal(refused.status, 409);
      assert.match(refused.problem.detail ?? "", /already expired/);
      assert.equal((await oncely.getRun(urgentId)).status, "expired");

      // Its one notification, run.expired, signed by the real relay and verified by the client.
      await waitFor("the run.expired webhook delivered", async () => {
        await api.relay.runOnce();
        return deliveries.length > 0;
      }, 10_000);
      assert.equal(deliveries.length, 1);
      assert.deepEqual(deliveries[0]!.event, {
        type: "run.expired",
        run_id: urgentId,
        task: "ticket",
        version: 1,
        status: "expired",
      });
    } finally {
      await worker?.stop();
      await receiver.shutdown();
      await api.close();
    }
  },
});
