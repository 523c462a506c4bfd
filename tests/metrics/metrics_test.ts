import assert from "node:assert/strict";
import type { Registry } from "prom-client";
import { apiMetrics, createRegistry, relayMetrics, serveMetrics, workerMetrics } from "../../src/metrics/metrics.ts";
import {
  attemptObserver,
  outboxGauges,
  QUEUE_DEPTH_TENANTS,
  queueGauges,
  relayEvents,
  workerEvents,
} from "../../src/processes/metrics_wiring.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { type ServiceKeys, serviceKeys } from "../../src/runs/keys.ts";
import { measureBacklog } from "../../src/queue/backlog.ts";
import type { RedisClient } from "../../src/clients.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";
import { apiHandler, relayTo, summaryWorker } from "../support/fixtures.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";

/** Parses Prometheus text format into `name{labels}` -> value, checking every line against the format. */
function parseExposition(text: string): Map<string, number> {
  const out = new Map<string, number>();
  const sample =
    /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (-?[0-9.e+]+|NaN|\+Inf|-Inf)$/;
  for (const line of text.split("\n")) {
    if (line === "") continue;
    if (line.startsWith("# HELP ") || line.startsWith("# TYPE ")) continue;
    const m = sample.exec(line);
    assert.ok(m, `valid exposition line: ${line}`);
    out.set(m[1]! + (m[2] ?? ""), Number(m[3]));
  }
  return out;
}

/** The backlog as a walk finds it now, on every scrape (the service reads the walker's snapshot instead). */
function liveBacklog(redis: RedisClient, keys: ServiceKeys) {
  return {
    read: () =>
      measureBacklog(redis, { active: keys.registry.active, keys: keys.backlog, lane: (id) => keys.lane(id) }),
  };
}

Deno.test("metrics", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  // The worker's step has lanes of its own, apart from the jobs the API's steps queue.
  const keys = serviceKeys(`${r.prefix}:worker`);
  const acme = keys.lane("acme");
  await createApiKey(db.sql, "acme"); // trusted-header mode serves only tenants that exist
  const handlerWith = (registry: Registry, token?: string) =>
    apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
      resultTtlS: 60,
      maxBodyBytes: 4096,
      metrics: { api: apiMetrics(registry), registry, token },
    });
  try {
    await t.step(
      "the API counts requests by route and status, replays, 409s and 422s, with a latency histogram",
      async () => {
        const registry = createRegistry();
        const handler = handlerWith(registry);
        const post = (key: string, text = "Revenue rose.") =>
          handler(
            new Request("http://api/v1/summaries", {
              method: "POST",
              headers: { "x-tenant-id": "acme", "idempotency-key": key, "content-type": "application/json" },
              body: JSON.stringify({ text, notify: "a@b.co" }),
            }),
          ).then((res) => res.arrayBuffer());
        await post("metrics-key-000001");
        await post("metrics-key-000001");
        await post("metrics-key-000001", "Another body.");
        const res = await handler(new Request("http://api/metrics"));
        assert.match(res.headers.get("content-type")!, /^text\/plain/);
        const m = parseExposition(await res.text());
        assert.equal(m.get('oncely_http_requests_total{route="/v1/summaries",method="POST",status="202"}'), 2);
        assert.equal(m.get('oncely_http_requests_total{route="/v1/summaries",method="POST",status="422"}'), 1);
        assert.equal(m.get("oncely_idempotent_replays_total"), 1);
        assert.equal(m.get("oncely_idempotency_key_reuse_total"), 1);
        assert.equal(m.get('oncely_http_request_duration_seconds_count{route="/v1/summaries",method="POST"}'), 3);
      },
    );

    await t.step(
      "invented methods and paths leave /metrics bounded: unknown methods get 501, or 405 on known paths",
      async () => {
        const registry = createRegistry();
        const handler = handlerWith(registry);
        const scrape = () => handler(new Request("http://api/metrics")).then((res) => res.text());
        // Warm every series a legitimate client can create, so growth below is only what attackers add.
        for (const path of ["/v1/summaries", "/healthz", "/metrics", "/nope"]) {
          await handler(new Request(`http://api${path}`)).then((res) => res.arrayBuffer());
        }
        const before = (await scrape()).length;
        const statuses = new Map<string, number>();
        for (let i = 0; i < 30; i++) {
          const method = `X${i}${"Q".repeat(60_000)}`;
          for (const path of ["/v1/summaries", `/v1/summaries/${crypto.randomUUID()}`, "/metrics", `/x/${i}`]) {
            const res = await handler(new Request(`http://api${path}`, { method }));
            await res.arrayBuffer();
            const route = path.startsWith("/x/") ? "unknown" : "known";
            statuses.set(`${route} ${res.status}`, (statuses.get(`${route} ${res.status}`) ?? 0) + 1);
          }
        }
        assert.deepEqual(Object.fromEntries(statuses), { "known 405": 90, "unknown 501": 30 });
        const text = await scrape();
        // At most a handful of new series (the 405 and 501 statuses under method="other"), never a 60 KB label.
        assert.ok(text.length - before < 8_000, `/metrics grew by ${text.length - before} bytes`);
        assert.doesNotMatch(text, /QQQQ/);
        const m = parseExposition(text);
        assert.equal(m.get('oncely_http_requests_total{route="other",method="other",status="501"}'), 30);
        assert.equal(m.get('oncely_http_requests_total{route="/metrics",method="other",status="405"}'), 30);
        // A known method on an unknown path is still a plain 404.
        const put = await handler(new Request("http://api/x", { method: "PUT" }));
        assert.equal(put.status, 404);
        await put.arrayBuffer();
      },
    );

    await t.step("with a token set, /metrics answers 401 without it and the metrics with it", async () => {
      const registry = createRegistry();
      const token = "metrics-token-0123456789";
      const handler = handlerWith(registry, token);
      for (const authorization of [undefined, "Bearer wrong-token", "Bearer metrics-token-012345678"]) {
        const res = await handler(
          new Request("http://api/metrics", { headers: authorization ? { authorization } : {} }),
        );
        assert.equal(res.status, 401);
        assert.doesNotMatch(await res.text(), /oncely_/);
      }
      const ok = await handler(
        new Request("http://api/metrics", { headers: { authorization: "Bearer metrics-token-0123456789" } }),
      );
      assert.equal(ok.status, 200);
      assert.match(await ok.text(), /oncely_http_requests_total/);
      // The worker's and relay's METRICS_PORT server keeps to the same token.
      const stop = new AbortController();
      const server = serveMetrics(registry, { hostname: "127.0.0.1", port: 0, signal: stop.signal, token });
      try {
        const url = `http://127.0.0.1:${(server.addr as Deno.NetAddr).port}/metrics`;
        const denied = await fetch(url);
        assert.equal(denied.status, 401);
        await denied.body?.cancel();
        const allowed = await fetch(url, { headers: { authorization: `Bearer ${token}` } });
        assert.equal(allowed.status, 200);
        assert.match(await allowed.text(), /oncely_http_requests_total/);
      } finally {
        stop.abort();
        await server.finished;
      }
    });

    await t.step(
      "the worker counts deliveries, retries by reason and dead letters, and reads pending and lag",
      async () => {
        const registry = createRegistry();
        const metrics = workerMetrics(registry);
        queueGauges(registry, liveBacklog(r.redis, keys));
        const model = startFakeModel((n) =>
          n === 1 ? { kind: "status", status: 429, headers: { "retry-after-ms": "1" } } : { kind: "ok" }
        );
        const worker = summaryWorker({
          redis: r.redis,
          sql: db.sql,
          llm: createOpenAiLlm({ apiKey: "k", model: "m", baseURL: model.url }),
          keys,
        }, {
          concurrency: 4,
          blockMs: 5,
          events: workerEvents(metrics),
          job: { budgetMs: 5_000, perCallTimeoutMs: 2_000, maxAttempts: 3, onAttempt: attemptObserver(metrics) },
        });
        try {
          await r.redis.del(acme.stream);
          await enqueueToLane(r.redis, keys, {
            jobId: crypto.randomUUID(),
            tenant: "acme",
            request: { text: "Revenue rose.", notify: "a@b.co" },
          });
          await enqueueToLane(r.redis, keys, {
            jobId: crypto.randomUUID(),
            tenant: "acme",
            request: { text: "Costs fell.", notify: "a@b.co" },
          });
          await worker.runOnce(0);
          await worker.drain();
          await r.redis.xadd(acme.stream, "*", "job_id", "bad", "tenant", "acme", "payload", "{}");
          await r.redis.xadd(acme.stream, "*", "job_id", "waiting", "tenant", "acme", "payload", "{}");
          await announceLane(r.redis, keys.registry, "acme");
          const m0 = parseExposition(await registry.metrics());
          assert.equal(m0.get("oncely_queue_lag"), 2);
          await worker.runOnce(0);
          await worker.drain();
          const m = parseExposition(await registry.metrics());
          assert.equal(m.get('oncely_worker_deliveries_total{source="new"}'), 4);
          assert.equal(m.get('oncely_model_retries_total{reason="http_429"}'), 1);
          assert.equal(m.get('oncely_model_attempts_total{outcome="ok"}'), 2);
          assert.equal(m.get("oncely_worker_dead_letters_total"), 2);
          assert.equal(m.get("oncely_worker_acked_total"), 2);
          assert.equal(m.get("oncely_queue_pending"), 0);
          assert.equal(m.get("oncely_queue_lag"), 0);
          assert.equal(m.get("oncely_worker_jobs_in_flight"), 0);
        } finally {
          await worker.close();
          await model.close();
        }
      },
    );

    await t.step(
      "the worker's free slots are its concurrency less the runs held in a slow model call, and all free after",
      async () => {
        const CONCURRENCY = 4;
        const registry = createRegistry();
        const metrics = workerMetrics(registry);
        const lanes = serviceKeys(`${r.prefix}:slots`);
        const model = startFakeModel();
        const inner = createOpenAiLlm({ apiKey: "k", model: "m", baseURL: model.url });
        // Each model call waits for the gate before it reaches the (fake) provider: a slow model, held at will.
        let open!: () => void;
        const gate = new Promise<void>((resolve) => open = resolve);
        let calling = 0;
        const worker = summaryWorker({
          redis: r.redis,
          sql: db.sql,
          llm: {
            complete: async (prompt, options) => {
              calling++;
              await gate;
              return await inner.complete(prompt, options);
            },
          },
          keys: lanes,
        }, {
          concurrency: CONCURRENCY,
          blockMs: 5,
          events: workerEvents(metrics, { concurrency: CONCURRENCY }),
          job: { budgetMs: 30_000, perCallTimeoutMs: 20_000, maxAttempts: 1 },
        });
        const gauges = async () => {
          const m = parseExposition(await registry.metrics());
          return { free: m.get("oncely_worker_free_slots"), inFlight: m.get("oncely_worker_jobs_in_flight") };
        };
        /** Reads until `n` runs are inside the model call (each read starts at most as many as there are slots). */
        const holdUntil = async (n: number) => {
          const deadline = performance.now() + 10_000;
          while (calling < n) {
            assert.ok(performance.now() < deadline, `${n} runs in the model call (${calling} are)`);
            await worker.runOnce(0);
            await new Promise((res) => setTimeout(res, 5));
          }
        };
        const enqueue = (n: number) =>
          Promise.all(
            Array.from({ length: n }, () =>
              enqueueToLane(r.redis, lanes, {
                jobId: crypto.randomUUID(),
                tenant: "acme",
                request: { text: "Revenue rose.", notify: "a@b.co" },
              })),
          );
        try {
          assert.deepEqual(await gauges(), { free: CONCURRENCY, inFlight: 0 }, "an idle worker: every slot free");
          await enqueue(3);
          await holdUntil(3);
          assert.deepEqual(await gauges(), { free: CONCURRENCY - 3, inFlight: 3 }, "3 runs held in the model call");
          // Two more: one takes the last slot, the other waits in the stream (a full worker reads nothing).
          await enqueue(2);
          await holdUntil(4);
          for (let i = 0; i < 3; i++) assert.equal(await worker.runOnce(0), 0, "a full worker starts nothing");
          assert.equal(calling, 4);
          assert.deepEqual(await gauges(), { free: 0, inFlight: CONCURRENCY }, "every slot held: none free");
          open();
          await worker.drain();
          // The fifth run, read once slots are free again.
          await holdUntil(5);
          await worker.drain();
          assert.equal(model.requests, 5, "every run reached the model");
          assert.deepEqual(await gauges(), { free: CONCURRENCY, inFlight: 0 }, "after the runs: every slot free");
          assert.equal(parseExposition(await registry.metrics()).get("oncely_worker_acked_total"), 5);
        } finally {
          open();
          await worker.close();
          await model.close();
        }
      },
    );

    await t.step(
      "labelled counters exist at 0 before their first event; the depth gauge names at most 20 tenants",
      async () => {
        const registry = createRegistry();
        workerMetrics(registry);
        relayMetrics(registry);
        const lanes = serviceKeys(`${r.prefix}:depth`);
        queueGauges(registry, liveBacklog(r.redis, lanes));
        const before = parseExposition(await registry.metrics());
        for (
          const series of [
            'oncely_worker_deliveries_total{source="reclaimed"}',
            'oncely_model_attempts_total{outcome="give_up"}',
            'oncely_llm_429_total{kind="quota"}',
            'oncely_llm_breaker_transitions_total{to="open"}',
            'oncely_relay_sends_total{outcome="failed"}',
          ]
        ) assert.equal(before.get(series), 0, series);
        // 25 tenants with 1 to 25 jobs: the 20 deepest by name, the 5 shallowest (1 + ... + 5 = 15) as "other".
        for (let t = 1; t <= 25; t++) {
          for (let j = 0; j < t; j++) {
            await enqueueToLane(r.redis, lanes, {
              jobId: crypto.randomUUID(),
              tenant: `tenant-${t}`,
              request: { text: "Revenue rose.", notify: "a@b.co" },
            });
          }
        }
        const m = parseExposition(await registry.metrics());
        const depth = [...m.keys()].filter((k) => k.startsWith("oncely_queue_depth{"));
        assert.equal(depth.length, QUEUE_DEPTH_TENANTS + 1);
        assert.equal(m.get('oncely_queue_depth{tenant="tenant-25"}'), 25);
        assert.equal(m.get('oncely_queue_depth{tenant="tenant-5"}'), undefined);
        assert.equal(m.get('oncely_queue_depth{tenant="other"}'), 15);
      },
    );

    await t.step("promtool check metrics is clean on the api's, the worker's and the relay's /metrics", async (t) => {
      const promtool = await new Deno.Command("promtool", { args: ["--version"], stdout: "null", stderr: "null" })
        .output().then((o) => o.success, () => false);
      if (!promtool) {
        console.warn("promtool is not installed (Debian: prometheus); .ci/run installs it");
        return;
      }
      const api = createRegistry();
      const worker = createRegistry();
      const relay = createRegistry();
      apiMetrics(api);
      workerMetrics(worker);
      queueGauges(worker, liveBacklog(r.redis, serviceKeys(`${r.prefix}:depth`)));
      relayMetrics(relay);
      outboxGauges(relay, db.sql);
      for (const [name, registry] of [["api", api], ["worker", worker], ["relay", relay]] as const) {
        await t.step(name, async () => {
          const child = new Deno.Command("promtool", {
            args: ["check", "metrics"],
            stdin: "piped",
            stdout: "piped",
            stderr: "piped",
          }).spawn();
          const writer = child.stdin.getWriter();
          await writer.write(new TextEncoder().encode(await registry.metrics()));
          await writer.close();
          const { code, stdout, stderr } = await child.output();
          const out = new TextDecoder().decode(stdout) + new TextDecoder().decode(stderr);
          assert.equal(code, 0, out);
          assert.equal(out.trim(), "", out);
        });
      }
    });

    await t.step(
      "the relay counts sends by outcome and reads the backlog and the oldest unsent row's age",
      async () => {
        const registry = createRegistry();
        outboxGauges(registry, db.sql);
        await db.sql`TRUNCATE outbox`;
        await db.sql`
        INSERT INTO outbox (topic, dedupe_key, payload, created_at) VALUES
          ('email.summary_ready', 'summary_ready:a', '{"job_id":"a","to":"a@b.co","summary":"s"}', now() - interval '60 seconds'),
          ('email.summary_ready', 'summary_ready:b', '{"job_id":"b","to":"a@b.co","summary":"s"}', now())`;
        const before = parseExposition(await registry.metrics());
        assert.equal(before.get("oncely_outbox_unsent"), 2);
        assert.ok(before.get("oncely_outbox_oldest_unsent_seconds")! >= 59);
        const mail = startFakeMail((n) => (n === 1 ? { kind: "status", status: 500 } : { kind: "ok" }));
        try {
          const relay = relayTo({ sql: db.sql, mailUrl: mail.url }, {
            batch: 1,
            events: relayEvents(relayMetrics(registry)),
          });
          await relay.runOnce();
          await relay.runOnce();
          await new Promise((res) => setTimeout(res, 1_100)); // the backlog gauge caches for 1 s
          const after = parseExposition(await registry.metrics());
          assert.equal(after.get('oncely_relay_sends_total{outcome="retry"}'), 1);
          assert.equal(after.get('oncely_relay_sends_total{outcome="sent"}'), 1);
          assert.equal(after.get("oncely_outbox_unsent"), 1);
        } finally {
          await mail.close();
        }
      },
    );
  } finally {
    await r.close();
    await db.close();
  }
});
