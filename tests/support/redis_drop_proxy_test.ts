/**
 * The Redis drop proxy: a reply it drops was run by Redis and never heard
 * by the client; at share 0 it is transparent (pipelines, transactions,
 * scripts, large values, pub/sub); at 3%, ioredis reconnects and resends,
 * and every command ends with a result.
 */
import assert from "node:assert/strict";
import { Redis } from "ioredis";
import { connectRedis } from "../../src/clients.ts";
import { createTestRedis, REDIS_URL, waitFor } from "../_support.ts";
import { connectionRandom, startRedisDropProxy } from "./redis_drop_proxy.ts";

/** The local Redis the tests' scratch prefixes live on. */
const target = { hostname: new URL(REDIS_URL).hostname, port: Number(new URL(REDIS_URL).port) };
/** A Redis Cluster answers MOVED with its nodes' own ports, around the proxy: these tests need one server. */
const ignore = Deno.env.get("ONCELY_TEST_CLUSTER") === "1";

/** A command in RESP, as a client sends it. */
function command(...args: string[]): Uint8Array {
  const enc = new TextEncoder();
  return enc.encode(`*${args.length}\r\n${args.map((a) => `$${enc.encode(a).length}\r\n${a}\r\n`).join("")}`);
}

/** Reads from `conn` until it is closed: @returns the bytes received meanwhile. */
async function readUntilClosed(conn: Deno.Conn): Promise<Uint8Array> {
  const chunks: number[] = [];
  const buf = new Uint8Array(4096);
  for (;;) {
    let n: number | null;
    try {
      n = await conn.read(buf);
    } catch {
      n = null; // reset by the peer
    }
    if (n === null) return new Uint8Array(chunks);
    chunks.push(...buf.subarray(0, n));
  }
}

Deno.test({
  name:
    "at share 1, an INCR is run by Redis but its client sees its connection closed, with no reply (a PING's passes)",
  ignore,
  async fn() {
    const r = await createTestRedis();
    const proxy = startRedisDropProxy({ target, share: 1, seed: 7 });
    try {
      const key = `${r.prefix}:counter`;
      const conn = await Deno.connect({ hostname: proxy.hostname, port: proxy.port });
      await conn.write(new Uint8Array([...command("PING"), ...command("INCR", key)]));
      const received = new TextDecoder().decode(await readUntilClosed(conn));
      conn.close();
      assert.equal(received, "+PONG\r\n", "not a byte of the INCR's reply reached the client");
      // Redis ran it.
      assert.equal(await r.redis.get(key), "1");
      await waitFor("the proxy to count the drop", () => proxy.stats.drops === 1);
      assert.deepEqual(
        { ...proxy.stats },
        { connections: 1, spared: 0, commands: 2, replies: 1, drops: 1, unanswered: 1 },
      );
    } finally {
      await proxy.close();
      await r.close();
    }
  },
});

Deno.test({
  name: "a drop ends at a reply's boundary: the replies before it pass whole, the commands after it go unanswered",
  ignore,
  async fn() {
    const r = await createTestRedis();
    // A seed whose third draw is the first under 0.5 on connection 1: replies 1 and 2 pass, 3 is dropped.
    const proxy = startRedisDropProxy({ target, share: 0.5, seed: findSeed([false, false, true], 0.5) });
    try {
      const key = `${r.prefix}:pipelined`;
      const conn = await Deno.connect({ hostname: proxy.hostname, port: proxy.port });
      // Five pipelined in one write; the second reply is a 100 KB bulk string, read in many chunks.
      const big = "x".repeat(100_000);
      await r.redis.set(`${key}:big`, big);
      const parts = [
        command("INCR", key),
        command("GET", `${key}:big`),
        command("INCR", key),
        command("INCR", key),
        command("INCR", key),
      ];
      await conn.write(new Uint8Array(parts.flatMap((p) => [...p])));
      const received = new TextDecoder().decode(await readUntilClosed(conn));
      conn.close();
      assert.equal(received, `:1\r\n$100000\r\n${big}\r\n`);
      assert.equal(await r.redis.get(key), "4", "Redis ran all four INCRs; the client heard of one");
      await waitFor("the drop counted", () => proxy.stats.drops === 1);
      assert.equal(proxy.stats.replies, 2);
      assert.equal(proxy.stats.unanswered, 3);
    } finally {
      await proxy.close();
      await r.close();
    }
  },
});

/** A seed whose first draws on connection 1 fall under `share` exactly where `drops` says (found by trying). */
function findSeed(drops: boolean[], share: number): number {
  for (let seed = 1;; seed++) {
    const random = connectionRandom(seed, 1);
    if (drops.every((drop) => (random() < share) === drop)) return seed;
  }
}

Deno.test({
  name: "at share 0 the proxy is transparent: pipelines, MULTI/EXEC, scripts, large values, streams and pub/sub",
  ignore,
  async fn() {
    const r = await createTestRedis();
    const proxy = startRedisDropProxy({ target, share: 0 });
    const client = new Redis(proxy.url(), { maxRetriesPerRequest: 0, connectionName: "through-proxy" });
    const subscriber = new Redis(proxy.url(), { maxRetriesPerRequest: 0 });
    try {
      const k = (name: string) => `${r.prefix}:${name}`;
      assert.equal(await client.set(k("a"), "1"), "OK");
      const piped = await client.pipeline().incr(k("a")).get(k("a")).del(k("none")).exec();
      assert.deepEqual(piped, [[null, 2], [null, "2"], [null, 0]]);
      const tx = await client.multi().incr(k("a")).incrby(k("a"), 10).exec();
      assert.deepEqual(tx, [[null, 3], [null, 13]]);
      // EVAL, then EVALSHA of the cached script: one reply each, nested arrays included.
      const script = "return {KEYS[1], {tonumber(ARGV[1]) + 1, 'x'}, redis.call('GET', KEYS[1])}";
      assert.deepEqual(await client.eval(script, 1, k("a"), "41"), [k("a"), [42, "x"], "13"]);
      const sha = await client.script("LOAD", script) as string;
      assert.deepEqual(await client.evalsha(sha, 1, k("a"), "1"), [k("a"), [2, "x"], "13"]);
      const big = "é".repeat(600_000); // 1.2 MB: many reads on each side
      await client.set(k("big"), big);
      assert.equal(await client.get(k("big")), big);
      await client.xadd(k("stream"), "*", "f", "v");
      const entries = await client.xrange(k("stream"), "-", "+");
      assert.equal(entries.length, 1);
      assert.equal(await client.get(k("none")), null);
      await assert.rejects(client.hget(k("a"), "f"), /WRONGTYPE/);
      // Pub/sub: the subscriber's connection is left alone, and its pushes pass.
      const got = new Promise<string>((resolve) => subscriber.once("message", (_channel, message) => resolve(message)));
      await subscriber.subscribe(k("channel"));
      await client.publish(k("channel"), "hello");
      assert.equal(await got, "hello");
      assert.equal(proxy.stats.drops, 0);
      assert.equal(proxy.stats.spared, 1);
      assert.equal(await r.redis.get(k("a")), "13");
      const names = await r.redis.client("LIST") as string;
      assert.match(names, /name=through-proxy/);
    } finally {
      client.disconnect();
      subscriber.disconnect();
      await proxy.close();
      await r.close();
    }
  },
});

Deno.test({
  name: "at 3%, pipelines of 100 commands reconnect and every command ends with a result; some ran twice",
  ignore,
  async fn() {
    const r = await createTestRedis();
    const proxy = startRedisDropProxy({ target, share: 0.03, seed: 42 });
    // The service's own client: resends unanswered commands after reconnecting, and never gives up on one.
    const client = await connectRedis(proxy.url(), { name: "pipelines" });
    let readies = 0;
    client.on("ready", () => readies++);
    try {
      const k = (i: number) => `${r.prefix}:n${i}`;
      const rounds = 10, size = 100;
      let aborted = 0;
      for (let round = 0; round < rounds; round++) {
        // Each command of the pipeline increments its own counter; one whose result is an error is sent again.
        let todo = Array.from({ length: size }, (_, i) => round * size + i);
        for (let tries = 0; todo.length > 0; tries++) {
          assert.ok(tries < 50, `round ${round}: ${todo.length} commands still without a result after 50 tries`);
          const pipeline = client.pipeline();
          for (const i of todo) pipeline.incr(k(i));
          const results = (await pipeline.exec())!;
          assert.equal(results.length, todo.length);
          const failed = todo.filter((_, n) => results[n]![0] !== null);
          for (const [error] of results) if (error) assert.match(error.message, /aborted|closed/i, error.message);
          aborted += failed.length;
          todo = failed;
        }
      }
      // Auto-pipelined single commands, all at once (the service's client pipelines what one tick sends): those
      // wholly unanswered are resent after the reconnect; those after a partial answer are aborted, and sent again.
      let todo = Array.from({ length: 500 }, (_, i) => rounds * size + i);
      for (let tries = 0; todo.length > 0; tries++) {
        assert.ok(tries < 50, `${todo.length} single commands still without a result after 50 tries`);
        const settled = await Promise.allSettled(todo.map((i) => client.incr(k(i))));
        for (const s of settled) if (s.status === "rejected") assert.match(String(s.reason), /aborted|closed/i);
        const failed = todo.filter((_, n) => settled[n]!.status === "rejected");
        aborted += failed.length;
        todo = failed;
      }
      const total = rounds * size + 500;
      const values = (await r.redis.mget(...Array.from({ length: total }, (_, i) => k(i)))).map(Number);
      const ranTwice = values.reduce((sum, v) => sum + v, 0) - total;
      console.log(
        `  ${proxy.stats.drops} replies dropped of ${proxy.stats.commands} commands, ${readies} connections ready, ` +
          `${aborted} commands aborted and sent again, ${ranTwice} INCRs ran more than once`,
      );
      assert.ok(values.every((v) => v >= 1), "every command ran at least once");
      assert.ok(proxy.stats.drops > 0, "replies were dropped");
      assert.ok(readies > 1, "the client reconnected");
      assert.ok(ranTwice <= proxy.stats.unanswered, "only a command whose reply was lost can have run twice");
    } finally {
      await client.quit().catch(() => client.disconnect());
      await proxy.close();
      await r.close();
    }
  },
});

Deno.test({
  name: "drops can be kept to some connections: the filter sees each one's name",
  ignore,
  async fn() {
    const r = await createTestRedis();
    const proxy = startRedisDropProxy({ target, share: 1, dropOn: (c) => c.name === "victim" });
    const spared = new Redis(proxy.url(), { maxRetriesPerRequest: 0, connectionName: "spared" });
    try {
      // The filter is asked at each reply, with the name CLIENT SETNAME gave (ioredis sends it for connectionName).
      for (let i = 0; i < 20; i++) assert.equal(await spared.incr(`${r.prefix}:c`), i + 1);
      assert.equal(proxy.stats.drops, 0);
      const conn = await Deno.connect({ hostname: proxy.hostname, port: proxy.port });
      await conn.write(
        new Uint8Array([...command("CLIENT", "SETNAME", "victim"), ...command("INCR", `${r.prefix}:c`)]),
      );
      // CLIENT's reply is spared (connection set-up); the INCR's is dropped.
      assert.equal(new TextDecoder().decode(await readUntilClosed(conn)), "+OK\r\n");
      conn.close();
      await waitFor("the victim's drop counted", () => proxy.stats.drops === 1);
      assert.equal(await r.redis.get(`${r.prefix}:c`), "21");
    } finally {
      spared.disconnect();
      await proxy.close();
      await r.close();
    }
  },
});
