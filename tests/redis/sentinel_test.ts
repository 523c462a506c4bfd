/**
 * Redis behind Sentinel: REDIS_URL=redis+sentinel://... is parsed and
 * checked at start-up; the client asks the sentinels for the master and
 * carries on through a failover (the primary SIGKILLed, then a manual
 * failover with the old master alive), as do `/readyz` and intake; the
 * launcher grants the sentinels and every node they may hand out.
 */
import assert from "node:assert/strict";
import { Redis } from "ioredis";
import { launchFlags } from "../../main.ts";
import { connectRedis, DependencyDown, type RedisClient } from "../../src/clients.ts";
import { ConfigError, parseConfig, parseSentinelUrl } from "../../src/config.ts";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { redisProbeFlags } from "../../src/permissions.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { createTestDatabase, freePort, waitFor } from "../_support.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { startRedisSentinel } from "../support/redis_sentinel.ts";

const ROOT = decodeURIComponent(new URL("../..", import.meta.url).pathname);

Deno.test("parseConfig() accepts REDIS_URL's Sentinel form: sentinels, SERVICE, DB and the data nodes' login", () => {
  const { REDIS_URL } = parseConfig({ REDIS_URL: "redis+sentinel://u:p%40ss@10.0.0.1:26380,Sentinel-B,[::1]:5/svc/3" });
  assert.deepEqual(parseSentinelUrl(REDIS_URL), {
    sentinels: [{ host: "10.0.0.1", port: 26380 }, { host: "sentinel-b", port: 26379 }, { host: "[::1]", port: 5 }],
    service: "svc",
    db: 3,
    username: "u",
    password: "p@ss",
  });
  assert.deepEqual(parseSentinelUrl("redis+sentinel://:secret@h/mymaster"), {
    sentinels: [{ host: "h", port: 26379 }],
    service: "mymaster",
    db: 0,
    username: undefined,
    password: "secret",
  });
  assert.equal(parseSentinelUrl("redis+sentinel://h/mymaster/").db, 0);
});

Deno.test("parseConfig() refuses a Sentinel URL without hosts or SERVICE, or with a bad DB or port, in one line", () => {
  const cases: [string, RegExp][] = [
    ["redis+sentinel:///mymaster/0", /REDIS_URL names no sentinel host/],
    ["redis+sentinel://u:p@/mymaster", /REDIS_URL names no sentinel host/],
    ["redis+sentinel://10.0.0.1:26379", /REDIS_URL names no SERVICE/],
    ["redis+sentinel://10.0.0.1:26379/", /REDIS_URL names no SERVICE/],
    ["redis+sentinel://10.0.0.1/mymaster/one", /REDIS_URL has a bad DB \("one"\)/],
    ["redis+sentinel://10.0.0.1/mymaster/-1", /REDIS_URL has a bad DB/],
    ["redis+sentinel://10.0.0.1/mymaster/0/1", /REDIS_URL has a bad DB \("0\/1"\)/],
    [
      "redis+sentinel://10.0.0.1:99999/mymaster",
      /REDIS_URL names a sentinel that is not host:port \(got "10\.0\.0\.1:99999"/,
    ],
    ["redis+sentinel://10.0.0.1:x/mymaster", /not host:port/],
    ["redis+sentinel://10.0.0.1/mymaster?db=1", /REDIS_URL takes no query/],
    ["redis+sentinel://10.0.0.1/my%zzmaster", /malformed percent-encoding in its SERVICE/],
  ];
  for (const [value, message] of cases) {
    assert.throws(() => parseConfig({ REDIS_URL: value }), (e: unknown) => {
      assert.ok(e instanceof ConfigError);
      assert.equal(e.variable, "REDIS_URL");
      assert.match(e.message, message);
      assert.ok(!e.message.includes("\n"), "one line");
      return true;
    }, value);
  }
  // A URL carrying a password is never echoed.
  assert.throws(() => parseConfig({ REDIS_URL: "redis+sentinel://u:hunter2@h" }), (e: Error) => {
    assert.doesNotMatch(e.message, /hunter2/);
    return true;
  });
});

/** Every subscriber connection the sentinels at `ports` have (ioredis's failover detector keeps one each). */
async function sentinelSubscribers(ports: number[]): Promise<number> {
  let count = 0;
  for (const port of ports) {
    const redis = new Redis({ host: "127.0.0.1", port, maxRetriesPerRequest: 0 });
    const list = await redis.call("CLIENT", "LIST") as string;
    count += list.split("\n").filter((line) => /\bsub=[1-9]/.test(line)).length;
    redis.disconnect();
  }
  return count;
}

/** Samples `/readyz` every 100 ms until `stop()`: each status with the time since `t0`. */
function sampleReadyz(handler: (req: Request) => Promise<Response>, t0: number) {
  const seen: { atMs: number; status: number }[] = [];
  let running = true;
  const done = (async () => {
    while (running) {
      const res = await handler(new Request("http://api/readyz"));
      await res.body?.cancel();
      seen.push({ atMs: Math.round(performance.now() - t0), status: res.status });
      await new Promise((r) => setTimeout(r, 100));
    }
  })();
  return {
    seen,
    async stop() {
      running = false;
      await done;
    },
  };
}

Deno.test("Redis behind Sentinel", async (t) => {
  const sentinel = await startRedisSentinel();
  const db = await createTestDatabase();
  await createApiKey(db.sql, "acme"); // trusted-header mode serves only tenants that exist
  const clients: RedisClient[] = [];
  const service = serviceKeys(`oncely_sentinel_${crypto.randomUUID().slice(0, 8)}`);
  const url = sentinel.url.replace(/\/0$/, "/2"); // a database other than 0, to see it honoured
  let api: { process: Deno.ChildProcess; stderr: Promise<string>; port: number } | undefined;
  const apiReady = async () => {
    const res = await fetch(`http://127.0.0.1:${api!.port}/readyz`).catch(() => undefined);
    await res?.body?.cancel();
    return res?.status === 200;
  };
  try {
    await t.step("connectRedis() asks the sentinels for the master, writes to it and honours the DB", async () => {
      const client = await connectRedis(url, { name: "oncely" });
      clients.push(client);
      await client.set("sentinel:probe", "1");
      const direct = new Redis({ host: "127.0.0.1", port: sentinel.primaryPort, db: 2 });
      assert.equal(await direct.get("sentinel:probe"), "1", "written to the primary, database 2");
      direct.disconnect();
      assert.ok(await sentinelSubscribers(sentinel.sentinelPorts) >= 3, "the failover detector listens on each");

      // Closing a client (and its duplicate) closes its subscriptions at the sentinels too.
      const extra = await connectRedis(url);
      const duplicate = (extra as Redis).duplicate();
      await duplicate.subscribe("sentinel:wake");
      const before = await sentinelSubscribers(sentinel.sentinelPorts);
      await duplicate.quit();
      await extra.quit();
      await waitFor(
        "the closed clients' sentinel subscriptions to go",
        async () => (await sentinelSubscribers(sentinel.sentinelPorts)) === before - 6,
      );
    });

    await t.step("a service the sentinels do not monitor stops start-up with a message naming it", async () => {
      const wrong = sentinel.url.replace(`/${sentinel.service}/`, "/nosuchservice/");
      await assert.rejects(connectRedis(wrong), (e: unknown) => {
        assert.ok(e instanceof DependencyDown);
        assert.match(e.message, /no sentinel of redis\+sentinel:\/\/127\.0\.0\.1:\d+,.*\/nosuchservice \(REDIS_URL\)/);
        assert.match(e.message, /names a master of "nosuchservice"/);
        return true;
      });
    });

    await t.step(
      "the launcher's probe, which may reach only the sentinels, lists every sentinel and data node",
      async () => {
        const config = parseConfig({ REDIS_URL: url });
        const sentinels = sentinel.sentinelPorts.map((p) => `127.0.0.1:${p}`);
        const data = [sentinel.primaryPort, sentinel.replicaPort].map((p) => `127.0.0.1:${p}`);
        assert.deepEqual(redisProbeFlags(config)[0], `--allow-net=${sentinels.join(",")}`);
        const out = await new Deno.Command(Deno.execPath(), {
          args: ["run", ...redisProbeFlags(config), "main.ts", "redis-nodes"],
          cwd: ROOT,
          env: { REDIS_URL: url },
          stdout: "piped",
          stderr: "piped",
        }).output();
        assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
        const listed = new TextDecoder().decode(out.stdout).trim().split("\n").sort();
        assert.deepEqual(listed, [...sentinels, ...data].sort());

        // What `deno task api` gets: every sentinel and data node, Postgres and its port; the relay is denied them all.
        const allowed = (await launchFlags("api", config)).find((f) => f.startsWith("--allow-net="))!;
        assert.deepEqual(
          allowed.slice("--allow-net=".length).split(",").sort(),
          [...sentinels, ...data, "127.0.0.1:5432", "127.0.0.1:8000"].sort(),
        );
        const denied = (await launchFlags("relay", config)).find((f) => f.startsWith("--deny-net="))!;
        for (const host of [...sentinels, ...data]) assert.ok(denied.split(/[=,]/).includes(host), host);
      },
    );

    await t.step("deno task api starts on the Sentinel URL and is ready", async () => {
      const port = freePort();
      const process = new Deno.Command(Deno.execPath(), {
        args: ["task", "api"],
        cwd: ROOT,
        env: { REDIS_URL: url, DATABASE_URL: db.url, PORT: String(port), LOG_LEVEL: "error", NO_COLOR: "1" },
        stdout: "null",
        stderr: "piped",
      }).spawn();
      api = { process, stderr: new Response(process.stderr).text(), port };
      await waitFor("the api process to be ready", apiReady, 20_000);
    });

    await t.step(
      "after a SIGKILL of the primary: the same clients carry on, /readyz is 200 and intake accepts again",
      async () => {
        const worker = clients[0]!; // waits out a reconnect, as the worker's client does
        const fast = await connectRedis(url, { name: "oncely", failFast: true }); // the API's
        clients.push(fast);
        const handler = apiHandler({ redis: fast, sql: db.sql, keys: service });
        const subscriber = (worker as Redis).duplicate();
        subscriber.on("error", () => {}); // as the lanes' subscriber: reconnects are retried
        const messages: string[] = [];
        subscriber.on("message", (_channel: string, message: string) => messages.push(message));
        await subscriber.subscribe("sentinel:wake");

        await worker.set("sentinel:counter", "0");
        assert.equal(await worker.wait(1, 2_000), 1, "the replica has the counter before the kill");
        const post = (key: string) =>
          handler(
            new Request("http://api/v1/summaries", {
              method: "POST",
              headers: { "x-tenant-id": "acme", "idempotency-key": key, "content-type": "application/json" },
              body: JSON.stringify({ text: "The primary died. A replica took over.", notify: "ops@example.com" }),
            }),
          );
        const t0 = performance.now();
        await sentinel.killPrimary();
        const ready = sampleReadyz(handler, t0);
        // Issued while there is no master: it waits and lands on the new one.
        const queuedWrite = worker.incr("sentinel:counter");
        // A POST every 250 ms until the sentinels agree on a new master, each with a key of its own.
        const posts: Promise<{ key: string; status: number; atMs: number; tookMs: number }>[] = [];
        let electing = true;
        const poster = (async () => {
          while (electing) {
            const key = `sentinel-during-${String(posts.length).padStart(4, "0")}`;
            const atMs = Math.round(performance.now() - t0);
            posts.push(
              post(key).then(async (res) => {
                await res.body?.cancel();
                return { key, status: res.status, atMs, tookMs: Math.round(performance.now() - t0) - atMs };
              }),
            );
            await new Promise((r) => setTimeout(r, 250));
          }
        })();
        const { afterKillMs } = await sentinel.waitForFailover();
        electing = false;
        await poster;
        const promoted = performance.now();
        assert.equal(await queuedWrite, 1, "the write issued during the election landed once");
        const writeMs = Math.round(performance.now() - promoted);
        const during = await Promise.all(posts);
        await waitFor(
          "readyz 200 after the promotion",
          () => ready.seen.some((s) => s.atMs > afterKillMs && s.status === 200),
          10_000,
        );
        await ready.stop();
        const readyMs = ready.seen.find((s) => s.atMs > afterKillMs && s.status === 200)!.atMs - afterKillMs;
        await waitFor("the api process ready again", apiReady, 10_000);
        const apiMs = Math.round(performance.now() - promoted);
        console.log(JSON.stringify({
          promoted_after_kill_ms: afterKillMs,
          queued_write_after_promotion_ms: writeMs,
          readyz_200_after_promotion_ms: readyMs,
          api_process_ready_after_promotion_ms: apiMs,
          posts_during_election: during.map((p) => `${p.atMs}+${p.tookMs}:${p.status}`).join(" "),
          readyz: ready.seen.map((s) => `${s.atMs}:${s.status}`).join(" "),
        }));
        assert.ok(ready.seen.some((s) => s.atMs < afterKillMs && s.status === 503), "503 while there is no master");
        assert.ok(readyMs <= 10_000);
        for (const { key, status } of during) assert.ok(status === 202 || status === 500, `${key}: ${status}`);

        // A refused POST is retried with its key, as the problem document says; then one more, new one.
        for (const { key } of during.filter((p) => p.status !== 202)) {
          const retried = await post(key);
          assert.equal(retried.status, 202, `${key} retried`);
          await retried.body?.cancel();
        }
        const accepted = await post("sentinel-after-0001");
        assert.equal(accepted.status, 202, await accepted.clone().text());
        await accepted.body?.cancel();
        // The lanes' wake-up subscription was renewed on the new master.
        await waitFor("a publish to reach the resubscribed duplicate", async () => {
          await worker.publish("sentinel:wake", "after");
          return messages.includes("after");
        }, 10_000);
        // Every accepted job is done once: one summary row each, none twice.
        const jobs = during.length + 1;
        const run = summaryWorker({ redis: worker, sql: db.sql, llm: createExtractiveLlm(), keys: service });
        const stop = new AbortController();
        const loop = run.run(stop.signal);
        const summaries = async () => (await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM summaries`)[0]!.n;
        try {
          await waitFor(`${jobs} summaries`, async () => (await summaries()) >= jobs, 15_000);
        } finally {
          stop.abort();
          await loop;
          await run.close();
          await subscriber.quit();
        }
        assert.equal(await summaries(), jobs, "one summary per accepted POST");
      },
    );

    await t.step("a manual failover with the old master alive: the same client writes to the new master", async () => {
      await sentinel.restartOldPrimary();
      const client = clients[0]!;
      const before = await sentinel.masterPort();
      const t0 = performance.now();
      const admin = new Redis({ host: "127.0.0.1", port: sentinel.sentinelPorts[0]!, maxRetriesPerRequest: 0 });
      try {
        // Refused (NOGOODSLAVE) until this sentinel has seen the restarted replica answer for a while.
        await waitFor(
          "a failover the sentinel accepts",
          () => admin.call("SENTINEL", "FAILOVER", sentinel.service).then(() => true, () => false),
          15_000,
        );
      } finally {
        admin.disconnect();
      }
      const after = await waitFor("the sentinels to name another master", async () => {
        const port = await sentinel.masterPort();
        return port !== before ? port : undefined;
      }, 15_000);
      const switchedMs = Math.round(performance.now() - t0);
      const direct = new Redis({ host: "127.0.0.1", port: after, db: 2, maxRetriesPerRequest: 0 });
      try {
        // Until the client has moved, a write may reach the old master (and be dropped when it resyncs) or be
        // refused there (READONLY, which drops the connection); callers retry, as this loop does.
        await waitFor("a write from the same client on the new master", async () => {
          const value = crypto.randomUUID();
          if (!(await client.set("sentinel:after-manual", value).then(() => true, () => false))) return false;
          return (await direct.get("sentinel:after-manual")) === value;
        }, 10_000);
      } finally {
        direct.disconnect();
      }
      const writeMs = Math.round(performance.now() - t0);
      await waitFor("the api process ready after the manual failover", apiReady, 10_000);
      console.log(JSON.stringify({ manual_failover_switched_ms: switchedMs, write_on_new_master_ms: writeMs }));
    });
  } finally {
    if (api) {
      api.process.kill("SIGTERM");
      const status = await api.process.status;
      const log = await api.stderr;
      assert.equal(status.code, 0, log.slice(-800));
      assert.doesNotMatch(log, /NotCapable|Requires net access/, "every node the sentinels named was allowed");
    }
    for (const client of clients) await client.quit().catch(() => client.disconnect());
    await db.close();
    await sentinel.stop();
  }
});
