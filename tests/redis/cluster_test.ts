/**
 * The service on a real three-master Redis Cluster, with REDIS_URL naming
 * one node: cluster mode is detected, and intake, the worker (reads,
 * heartbeats, acks, dead letters, replay) and the provider flow control all
 * run, because every multi-key step keeps its keys in one slot.
 */
import assert from "node:assert/strict";
import { Cluster } from "ioredis";
import { connectRedis, type RedisClient } from "../../src/clients.ts";
import { parseConfig } from "../../src/config.ts";
import { redisProbeFlags } from "../../src/permissions.ts";
import { createProviderFlow, providerStateKey } from "../../src/provider/flow_control.ts";
import { deadLetter, listDeadLetters, replayDeadLetter } from "../../src/queue/dead_letter.ts";
import { createLogger, silentLogger } from "../../src/log/logger.ts";
import { markFailedHook, markQueuedOnReplay } from "../../src/runs/job_status.ts";
import { KEY_PREFIX, serviceKeys } from "../../src/runs/keys.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { createTestDatabase, freePort, waitFor } from "../_support.ts";
import { apiHandler, relayTo, summaryWorker } from "../support/fixtures.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { startLocalCluster } from "../support/redis_cluster.ts";

const ROOT = decodeURIComponent(new URL("../..", import.meta.url).pathname);

Deno.test("on a three-master Redis Cluster", async (t) => {
  const cluster = await startLocalCluster();
  const db = await createTestDatabase();
  await createApiKey(db.sql, "acme"); // trusted-header mode serves only tenants that exist
  let redis: RedisClient | undefined;
  try {
    await t.step("REDIS_URL naming one node is detected as a cluster, and a seed list is accepted", async () => {
      redis = await connectRedis(cluster.nodes[1]!);
      assert.ok(redis instanceof Cluster, "the cluster client");
      const seeded = await connectRedis(cluster.nodes.join(","));
      assert.ok(seeded instanceof Cluster);
      await seeded.quit();
    });
    const client = redis!;
    const service = serviceKeys(`oncely_cluster_${crypto.randomUUID().slice(0, 8)}`);
    // Tenant acme's lane: its stream, dead letters and records live in acme's slot.
    const keys = service.lane("acme");

    await t.step("POST, replay, key reuse, worker, relay and GET: one summary and one email per job", async () => {
      const mail = startFakeMail();
      const handler = apiHandler({ redis: client, sql: db.sql, keys: service, log: createLogger({ level: "error" }) });
      const worker = summaryWorker({ redis: client, sql: db.sql, llm: createExtractiveLlm(), keys: service }, {
        heartbeatMs: 50,
      });
      const relay = relayTo({ sql: db.sql, mailUrl: mail.url });
      const stop = new AbortController();
      const loops = [worker.run(stop.signal), relay.run(stop.signal)];
      try {
        const post = (key: string, text: string) =>
          handler(
            new Request("http://api/v1/summaries", {
              method: "POST",
              headers: { "x-tenant-id": "acme", "idempotency-key": key, "content-type": "application/json" },
              body: JSON.stringify({ text, notify: "ops@example.com" }),
            }),
          );
        const ids: string[] = [];
        for (let i = 0; i < 20; i++) {
          const res = await post(`cluster-key-${String(i).padStart(6, "0")}`, `Revenue rose ${i}%. Costs fell.`);
          assert.equal(res.status, 202);
          ids.push((await res.json()).job_id);
        }
        const replay = await post("cluster-key-000000", "Revenue rose 0%. Costs fell.");
        assert.equal(replay.headers.get("idempotent-replayed"), "true");
        await replay.body?.cancel();
        const reuse = await post("cluster-key-000000", "Another document.");
        assert.equal(reuse.status, 422);
        await reuse.body?.cancel();
        await waitFor("20 emails", () => mail.delivered.length === 20, 15_000);
        const [row] = await db.sql<{ s: number; o: number }[]>`
          SELECT (SELECT count(*) FROM summaries)::int AS s, (SELECT count(*) FROM outbox)::int AS o`;
        assert.deepEqual([row!.s, row!.o], [20, 20]);
        assert.equal(mail.requests, 20);
        const done = await handler(
          new Request(`http://api/v1/summaries/${ids[3]}`, { headers: { "x-tenant-id": "acme" } }),
        );
        assert.equal((await done.json()).status, "done");
        assert.deepEqual(await worker.heartbeat(), [], "nothing left in flight");
      } finally {
        stop.abort();
        await Promise.all(loops);
        await worker.close();
        await mail.close();
      }
    });

    await t.step("dead-lettering marks the job failed and replay re-queues it, each in one slot", async () => {
      const jobId = crypto.randomUUID();
      const id = await client.xadd(keys.stream, "*", "job_id", jobId, "tenant", "acme", "payload", "{}") as string;
      await deadLetter(
        client,
        keys,
        { id, fields: { job_id: jobId, tenant: "acme", payload: "{}" }, deliveries: 6 },
        "test",
        markFailedHook,
      );
      assert.equal(await client.hget(keys.job(jobId), "status"), "failed");
      const [dead] = await listDeadLetters(client, keys);
      assert.ok(await replayDeadLetter(client, keys, dead!.id, markQueuedOnReplay(keys, jobId)));
      assert.equal(await client.hget(keys.job(jobId), "status"), "queued");
    });

    await t.step("the provider flow control runs its scripts on the cluster", async () => {
      const flow = createProviderFlow({ redis: client, log: silentLogger }, {
        key: providerStateKey(keys.stream, { baseURL: "http://m", model: "m", apiKey: "k" }),
        rpm: 60_000,
        cooldownMs: 1_000,
        probeLeaseMs: 1_000,
      });
      const permit = await flow.acquire(10);
      assert.equal(await permit.settle({ value: { text: "ok" } }), false);
      assert.equal((await flow.status()).breaker.state, "closed");
      assert.ok((await flow.ready()).permits > 0);
    });
    await t.step("the launcher's probe, which may reach only the seed, lists every node of the cluster", async () => {
      const env = { REDIS_URL: cluster.nodes[0]! };
      const out = await new Deno.Command(Deno.execPath(), {
        args: ["run", ...redisProbeFlags(parseConfig(env)), "main.ts", "redis-nodes"],
        cwd: ROOT,
        env,
        stdout: "piped",
        stderr: "piped",
      }).output();
      assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
      const listed = new TextDecoder().decode(out.stdout).trim().split("\n").sort();
      assert.deepEqual(listed, cluster.nodes.map((n) => n.replace("redis://", "")).sort());
      // A standalone server has no other nodes.
      const alone = await new Deno.Command(Deno.execPath(), {
        args: ["run", ...redisProbeFlags(parseConfig({})), "main.ts", "redis-nodes"],
        cwd: ROOT,
        env: { REDIS_URL: "redis://127.0.0.1:6379" },
        stdout: "piped",
      }).output();
      assert.equal(new TextDecoder().decode(alone.stdout).trim(), "");
    });

    await t.step(
      "deno task worker, launched with REDIS_URL naming one node, may reach every node and runs a job",
      async () => {
        const processKeys = serviceKeys(KEY_PREFIX);
        const worker = new Deno.Command(Deno.execPath(), {
          args: ["task", "worker"],
          cwd: ROOT,
          env: { REDIS_URL: cluster.nodes[2]!, DATABASE_URL: db.url, LOG_LEVEL: "info", NO_COLOR: "1" },
          stdout: "null",
          stderr: "piped",
        }).spawn();
        const stderr = new Response(worker.stderr).text();
        try {
          const jobId = crypto.randomUUID();
          await enqueueToLane(client, processKeys, {
            jobId,
            tenant: "acme",
            request: { text: "The cluster test passed. Everyone went home.", notify: "ops@example.com" },
          });
          await waitFor("the worker's summary", async () => {
            const [row] = await db.sql`SELECT 1 FROM summaries WHERE job_id = ${jobId}`;
            return row !== undefined;
          }, 20_000);
        } finally {
          worker.kill("SIGTERM");
          const status = await worker.status;
          const log = await stderr;
          assert.equal(status.code, 0, log.slice(-800));
          assert.doesNotMatch(log, /NotCapable|Requires net access/);
        }
      },
    );
    await t.step("deno task dev runs on the cluster: POST, the job is done, GET shows the summary", async () => {
      const port = freePort();
      const dev = new Deno.Command(Deno.execPath(), {
        args: ["task", "dev"],
        cwd: ROOT,
        env: {
          REDIS_URL: cluster.nodes[1]!,
          DATABASE_URL: db.url,
          PORT: String(port),
          LOG_LEVEL: "warn",
          NO_COLOR: "1",
        },
        stdout: "piped",
        stderr: "piped",
      }).spawn();
      const stderr = new Response(dev.stderr).text();
      const lines = dev.stdout.pipeThrough(new TextDecoderStream()).getReader();
      try {
        let out = "";
        while (!/API key \(shown once\): (\S+)/.test(out) && !/Tenant "dev" exists/.test(out)) {
          const { value, done } = await lines.read();
          if (done) throw new Error(`dev exited: ${await stderr}`);
          out += value;
        }
        const key = /API key \(shown once\): (\S+)/.exec(out)![1]!;
        const base = `http://127.0.0.1:${port}`;
        await waitFor(
          "the API",
          () => fetch(`${base}/healthz`).then((r) => (r.body?.cancel(), r.ok), () => false),
          15_000,
        );
        const res = await fetch(`${base}/v1/summaries`, {
          method: "POST",
          headers: {
            authorization: `Bearer ${key}`,
            "idempotency-key": "dev-on-cluster-0001",
            "content-type": "application/json",
          },
          body: JSON.stringify({ text: "Revenue rose. Costs fell. The cluster held.", notify: "you@example.com" }),
        });
        assert.equal(res.status, 202);
        const { job_id } = await res.json();
        const doc = await waitFor("the summary", async () => {
          const r = await fetch(`${base}/v1/summaries/${job_id}`, { headers: { authorization: `Bearer ${key}` } });
          const body = await r.json();
          return body.status === "done" ? body : null;
        }, 15_000);
        assert.ok(doc.summary.length > 0);
      } finally {
        dev.kill("SIGTERM");
        assert.equal((await dev.status).code, 0);
        await lines.cancel().catch(() => {});
        await stderr;
      }
    });
  } finally {
    await redis?.quit().catch(() => redis?.disconnect());
    await db.close();
    await cluster.stop();
  }
});
