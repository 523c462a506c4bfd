import assert from "node:assert/strict";
import { Redis } from "ioredis";
import { dlqCommand } from "../../src/cli/dlq_command.ts";
import { connectRedis, type RedisClient } from "../../src/clients.ts";
import { ConfigError, parseConfig } from "../../src/config.ts";
import { canonicalJson } from "../../src/idempotency/fingerprint.ts";
import { jobIdFor } from "../../src/idempotency/scope.ts";
import { deadLetter } from "../../src/queue/dead_letter.ts";
import { fieldsToObject } from "../../src/redis/fields.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import { createReplicaAck, type ReplicaAck } from "../../src/redis/replica_ack.ts";
import { createIntake } from "../../src/runs/intake.ts";
import { markFailedHook } from "../../src/runs/job_status.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { createTestDatabase } from "../_support.ts";
import { apiHandler } from "../support/fixtures.ts";
import { startLocalCluster } from "../support/redis_cluster.ts";
import { startLocalReplication } from "../support/redis_replication.ts";

const BODY = { text: "Quarterly revenue rose. Costs fell. The board approved the plan.", notify: "ops@example.com" };
const TIMEOUT_MS = 500;
/** Generous: these machines are shared and noisy; the point is "about the timeout", not "forever". */
const MARGIN_MS = 2_000;
const PATH = "/v1/summaries";

const waitCalls = async (redis: Redis) =>
  Number(/cmdstat_wait:calls=(\d+)/.exec(await redis.info("commandstats"))?.[1] ?? 0);

Deno.test("REDIS_MIN_REPLICAS_ACK: answered only once the replicas have the job", async (t) => {
  const db = await createTestDatabase();
  await createApiKey(db.sql, "acme"); // the trusted-header gateway's tenant must exist
  const local = await startLocalReplication();
  const redis = await connectRedis(local.primary, { failFast: true }) as Redis;
  const replica = new Redis(local.replica);
  replica.on("error", () => {}); // killed and restarted below
  const keys = serviceKeys(`oncely_test_${crypto.randomUUID().slice(0, 8)}`);
  const lane = keys.lane("acme");
  const acks: ReplicaAck[] = [];
  const ackOf = () => {
    const ack = createReplicaAck(redis, { replicas: 1, timeoutMs: TIMEOUT_MS });
    acks.push(ack);
    return ack;
  };
  const intakeWith = (ack?: ReplicaAck) => createIntake({ redis, ack }, { keys, resultTtlS: 86_400, path: PATH });
  const handlerWith = (ack?: ReplicaAck) => apiHandler({ redis, sql: db.sql, keys }, { intake: intakeWith(ack) });
  const handler = handlerWith(ackOf());
  let n = 0;
  const newKey = () => `replicas-ack-${String(++n).padStart(8, "0")}`;
  const post = (key: string, via = handler) =>
    via(
      new Request(`http://api${PATH}`, {
        method: "POST",
        headers: { "x-tenant-id": "acme", "content-type": "application/json", "idempotency-key": key },
        body: JSON.stringify(BODY),
      }),
    );
  const scopeOf = (key: string) => ({ tenant: "acme", method: "POST", path: PATH, key });
  const jobIdOf = (key: string) => jobIdFor(scopeOf(key), canonicalJson(BODY));
  const hasRecord = (key: string, on: RedisClient) => intakeWith().hasRecord(scopeOf(key), on);
  const entriesOf = async (client: RedisClient, jobId: string) =>
    (await client.xrange(lane.stream, "-", "+")).filter(([, flat]) => fieldsToObject(flat).job_id === jobId).length;
  const timed = async (res: Promise<Response>) => {
    const start = performance.now();
    const response = await res;
    return { response, ms: performance.now() - start };
  };

  try {
    await t.step(
      "with the replica up, a POST answers 202 and the replica already holds the record and the job",
      async () => {
        const key = newKey();
        const res = await post(key);
        assert.equal(res.status, 202);
        assert.equal((await res.json()).job_id, jobIdOf(key));
        // WAIT counts replicas that applied the write: read the replica straight after the answer, no polling.
        assert.equal(await hasRecord(key, replica), true);
        assert.equal(await entriesOf(replica, jobIdOf(key)), 1);
        const again = await post(key);
        assert.equal(again.status, 202);
        assert.equal(again.headers.get("idempotent-replayed"), "true");
      },
    );

    await t.step("N=0 sends no WAIT; N=1 sends one per POST", async () => {
      const plain = handlerWith(undefined);
      const before = await waitCalls(redis);
      for (let i = 0; i < 3; i++) assert.equal((await post(newKey(), plain)).status, 202);
      assert.equal(await waitCalls(redis), before, "no WAIT without REDIS_MIN_REPLICAS_ACK");
      for (let i = 0; i < 3; i++) assert.equal((await post(newKey())).status, 202);
      assert.equal(await waitCalls(redis), before + 3);
    });

    await t.step(
      "replica stopped: 503 with Retry-After within the timeout, the record on the primary; back: the retry replays the same job once",
      async () => {
        const key = newKey();
        local.pause();
        try {
          const { response, ms } = await timed(post(key));
          assert.equal(response.status, 503);
          assert.equal(response.headers.get("retry-after"), "2");
          assert.equal(response.headers.get("content-type"), "application/problem+json");
          assert.match((await response.json()).detail, /same Idempotency-Key/);
          assert.ok(ms >= TIMEOUT_MS - 50, `waited for the replica (${ms.toFixed(0)} ms)`);
          assert.ok(ms < TIMEOUT_MS + MARGIN_MS, `answered within the timeout and a margin (${ms.toFixed(0)} ms)`);
          assert.equal(await hasRecord(key, redis), true, "the record may exist: here it does");
          assert.equal(await entriesOf(redis, jobIdOf(key)), 1);
        } finally {
          await local.resume();
        }
        const retry = await post(key);
        assert.equal(retry.status, 202);
        assert.equal(retry.headers.get("idempotent-replayed"), "true");
        assert.equal((await retry.json()).job_id, jobIdOf(key));
        assert.equal(await entriesOf(redis, jobIdOf(key)), 1, "the job is in the stream exactly once");
        assert.equal(await entriesOf(replica, jobIdOf(key)), 1);
      },
    );

    await t.step(
      "a replay on another connection (another API process) waits for the record too, not only for its own writes",
      async () => {
        const key = newKey();
        local.pause();
        try {
          assert.equal((await post(key)).status, 503);
          // WAIT covers the writes made before it on its own connection, and this process's has not written the
          // record. Redis 7.2 moves a client's WAIT offset only on its writes, so a bare read would be answered at
          // once with the replica counted; the replay's touch is a write, so it waits. (The Redis 7.0 of these
          // machines moves that offset on every command, so here this also passes without the touch.)
          const other = handlerWith(ackOf());
          const { response, ms } = await timed(post(key, other));
          assert.equal(response.status, 503);
          assert.ok(ms >= TIMEOUT_MS - 50, `the replay waited (${ms.toFixed(0)} ms)`);
        } finally {
          await local.resume();
        }
        const retry = await post(key, handlerWith(ackOf()));
        assert.equal(retry.status, 202);
        assert.equal(retry.headers.get("idempotent-replayed"), "true");
        assert.equal(await entriesOf(redis, jobIdOf(key)), 1);
      },
    );

    await t.step("concurrent POSTs beyond the connection pool all answer 503 within the timeout", async () => {
      local.pause();
      try {
        const started = performance.now();
        const responses = await Promise.all(Array.from({ length: 12 }, () => post(newKey())));
        const ms = performance.now() - started;
        assert.deepEqual(new Set(responses.map((r) => r.status)), new Set([503]));
        assert.ok(responses.every((r) => r.headers.get("retry-after") === "2"));
        assert.ok(ms < TIMEOUT_MS + MARGIN_MS, `all answered within the timeout and a margin (${ms.toFixed(0)} ms)`);
        await Promise.all(responses.map((r) => r.body?.cancel()));
      } finally {
        await local.resume();
      }
    });

    await t.step(
      "replica killed and restarted (full resync): the retry is a replay of the same job id; lost by a failover, an enqueue of it",
      async () => {
        const key = newKey();
        await local.killReplica();
        let restarted = false;
        try {
          const { response, ms } = await timed(post(key));
          assert.equal(response.status, 503);
          assert.ok(response.headers.has("retry-after"));
          assert.ok(ms < TIMEOUT_MS + MARGIN_MS, `${ms.toFixed(0)} ms`);
          await local.startReplica();
          restarted = true;
        } finally {
          if (!restarted) await local.startReplica();
        }
        const retry = await post(key);
        assert.equal(retry.status, 202);
        assert.equal(retry.headers.get("idempotent-replayed"), "true");
        assert.equal((await retry.json()).job_id, jobIdOf(key));
        assert.equal(await entriesOf(redis, jobIdOf(key)), 1);
        assert.equal(await hasRecord(key, replica), true);

        // As if a failover had promoted a replica that never got the first attempt: record, job and status gone.
        const lost = newKey();
        local.pause();
        try {
          assert.equal((await post(lost)).status, 503);
          const [entry] = (await redis.xrange(lane.stream, "-", "+")).filter(([, flat]) =>
            fieldsToObject(flat).job_id === jobIdOf(lost)
          );
          await intakeWith().forget(scopeOf(lost));
          await redis.multi().del(lane.job(jobIdOf(lost))).xdel(lane.stream, entry![0]).exec();
        } finally {
          await local.resume();
        }
        const enqueued = await post(lost);
        assert.equal(enqueued.status, 202);
        assert.equal(enqueued.headers.get("idempotent-replayed"), null);
        assert.equal((await enqueued.json()).job_id, jobIdOf(lost), "the same job id");
        assert.equal(await entriesOf(redis, jobIdOf(lost)), 1);
      },
    );

    await t.step("dlq replay waits for the replicas; not acknowledged in time, it says so and exits 3", async () => {
      const key = newKey();
      assert.equal((await post(key)).status, 202);
      await ensureGroup(redis, lane);
      const deadIdOf = async () => {
        const reply = await redis.xreadgroup("GROUP", lane.group, "c", "COUNT", 1000, "STREAMS", lane.stream, ">") as
          | [string, [string, string[]][]][]
          | null;
        for (const [id, flat] of reply?.[0]?.[1] ?? []) {
          const fields = fieldsToObject(flat);
          if (fields.job_id === jobIdOf(key)) {
            await deadLetter(redis, lane, { id, fields, deliveries: 6 }, "exceeded 5 deliveries", markFailedHook);
          }
        }
        const [dead] = (await redis.xrange(lane.dead, "-", "+")).filter(([, flat]) =>
          fieldsToObject(flat).job_id === jobIdOf(key)
        );
        return dead![0];
      };
      const run = async (args: string[]) => {
        const out: string[] = [], err: string[] = [];
        const code = await dlqCommand({ redis, sql: db.sql, ack: ackOf() }, keys, args, {
          out: (l) => out.push(l),
          err: (l) => err.push(l),
        });
        return { code, out, err };
      };

      const first = await deadIdOf();
      const healthy = await run(["replay", first, "--tenant", "acme"]);
      assert.equal(healthy.code, 0, healthy.err.join("\n"));
      assert.match(healthy.out.join("\n"), /1 dead letter\(s\) replayed\./);
      assert.equal(await entriesOf(replica, jobIdOf(key)), 1, "on the replica when the command answered");

      const second = await deadIdOf();
      local.pause();
      const result = await run(["replay", second, "--tenant", "acme"]).finally(() => local.resume());
      assert.equal(result.code, 3);
      assert.match(result.err.join("\n"), /was replayed as .* on the primary, but only 0 of 1 Redis replica/);
      assert.match(result.out.join("\n"), /not yet acknowledged by enough Redis replicas/);
      assert.equal(await entriesOf(redis, jobIdOf(key)), 1, "replayed once, on the primary");
      assert.equal(await redis.xlen(lane.dead), 0);
    });
  } finally {
    await Promise.all(acks.map((ack) => ack.close()));
    replica.disconnect();
    await redis.quit();
    await local.stop();
    await db.close();
  }
});

Deno.test("REDIS_MIN_REPLICAS_ACK on Redis Cluster: the WAIT goes with the script to the node that owns the lane", async () => {
  const cluster = await startLocalCluster();
  const redis = await connectRedis(cluster.nodes.join(","));
  const ack = createReplicaAck(redis, { replicas: 1, timeoutMs: 100 });
  const keys = serviceKeys(`oncely_test_${crypto.randomUUID().slice(0, 8)}`);
  const nodes = cluster.nodes.map((url) => new Redis(url));
  try {
    const intake = createIntake({ redis, ack }, { keys, resultTtlS: 60, path: PATH });
    const scope = { tenant: "acme", method: "POST", path: PATH, key: "cluster-key-0000001" };
    // No replicas in this cluster: never acknowledged, and the job is on its lane's node all the same.
    await assert.rejects(intake.submit({ scope, request: BODY }), { name: "NotReplicated" });
    // A node that does not own the slot answers MOVED.
    const owners = await Promise.all(
      nodes.map((node) => intake.hasRecord(scope, node).catch(() => false)),
    );
    const waits = await Promise.all(nodes.map(waitCalls));
    assert.equal(owners.filter(Boolean).length, 1);
    // One WAIT, or two when the node first answered NOSCRIPT; none anywhere else.
    assert.ok(
      waits.every((calls, i) => owners[i] ? calls >= 1 : calls === 0),
      `WAITs per node ${waits}, owner ${owners}`,
    );
  } finally {
    await ack.close();
    for (const node of nodes) node.disconnect();
    await redis.quit();
    await cluster.stop();
  }
});

Deno.test("REDIS_MIN_REPLICAS_ACK and REDIS_ACK_TIMEOUT_MS: defaults 0 and 500, bad values stop start-up by name", () => {
  const config = parseConfig({});
  assert.equal(config.REDIS_MIN_REPLICAS_ACK, 0);
  assert.equal(config.REDIS_ACK_TIMEOUT_MS, 500);
  assert.equal(parseConfig({ REDIS_MIN_REPLICAS_ACK: "2", REDIS_ACK_TIMEOUT_MS: "250" }).REDIS_MIN_REPLICAS_ACK, 2);
  const refused = (env: Record<string, string>, variable: string, message: RegExp) =>
    assert.throws(() => parseConfig(env), (error) => {
      assert.ok(error instanceof ConfigError);
      assert.equal(error.variable, variable);
      assert.match(error.message, message);
      return true;
    });
  refused(
    { REDIS_MIN_REPLICAS_ACK: "-1" },
    "REDIS_MIN_REPLICAS_ACK",
    /^Cannot start: REDIS_MIN_REPLICAS_ACK must be a whole number \(got "-1"\)/,
  );
  refused({ REDIS_MIN_REPLICAS_ACK: "one" }, "REDIS_MIN_REPLICAS_ACK", /must be a whole number/);
  refused({ REDIS_ACK_TIMEOUT_MS: "0" }, "REDIS_ACK_TIMEOUT_MS", /REDIS_ACK_TIMEOUT_MS must be at least 1 \(got "0"\)/);
  refused({ REDIS_ACK_TIMEOUT_MS: "120000" }, "REDIS_ACK_TIMEOUT_MS", /must be at most 60000/);
});
