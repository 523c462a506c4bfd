/**
 * Behind Sentinel, a node that joins after a process started is outside the
 * `--allow-net` its launcher derived then, and Deno cannot widen it while the
 * process runs. A replica added later is named in a warning before any
 * failover; once it is promoted, the process says so in one error line and
 * exits 1, and the next start (the launcher asks the sentinels again) reaches
 * it.
 */
import assert from "node:assert/strict";
import { parseSentinelUrl } from "../../src/config.ts";
import { type SentinelNode, sentinelNodes, watchSentinelNodes } from "../../src/redis/sentinel_nodes.ts";
import { createTestDatabase, freePort, waitFor } from "../_support.ts";
import { startRedisSentinel } from "../support/redis_sentinel.ts";

const ROOT = decodeURIComponent(new URL("../..", import.meta.url).pathname);

/** `deno task <name>` as an operator runs it (through the launcher), with its stderr collected as it comes. */
function startTask(name: string, env: Record<string, string>) {
  const process = new Deno.Command(Deno.execPath(), {
    args: ["task", name],
    cwd: ROOT,
    env: { LOG_LEVEL: "info", NO_COLOR: "1", ...env },
    stdin: "null",
    stdout: "null",
    stderr: "piped",
  }).spawn();
  let stderr = "";
  const read = (async () => {
    for await (const chunk of process.stderr.pipeThrough(new TextDecoderStream())) stderr += chunk;
  })();
  let exit: { code: number; atMs: number } | undefined;
  const status = process.status.then((s) => (exit = { code: s.code, atMs: performance.now() }));
  return {
    process,
    get stderr() {
      return stderr;
    },
    get exit() {
      return exit;
    },
    /** The JSON log lines with this event. */
    lines(event: string): Record<string, unknown>[] {
      return stderr.split("\n").filter((line) => line.includes(`"event":"${event}"`)).map((line) => JSON.parse(line));
    },
    /** SIGTERM unless it has exited already; then its status once its stderr is read. */
    async stop() {
      if (!exit) process.kill("SIGTERM");
      await Promise.all([status, read]);
      return exit!;
    },
  };
}

Deno.test("a replica added after start-up and then promoted: the process names it in one line and exits 1", async (t) => {
  const sentinel = await startRedisSentinel();
  const db = await createTestDatabase();
  const target = parseSentinelUrl(sentinel.url);
  const env = { REDIS_URL: sentinel.url, DATABASE_URL: db.url };
  const worker = startTask("worker", env);
  let api: ReturnType<typeof startTask> | undefined;
  const seen: SentinelNode[] = [];
  // What the launcher granted: every node the sentinels named before the new replica.
  const granted = new Set(await sentinelNodes(target));
  const watch = watchSentinelNodes(target, {
    granted: (address) => granted.has(address),
    everyMs: 200,
    onOutside: (node) => seen.push(node),
  });
  try {
    await waitFor("the worker to start", () => worker.lines("worker_started").length > 0 || worker.exit, 20_000);
    assert.equal(worker.exit, undefined, worker.stderr.slice(-800));

    let newNode = "";
    await t.step("watchSentinelNodes() names a replica that joined, once, before any failover", async () => {
      newNode = `127.0.0.1:${await sentinel.addReplica({ priority: 1 })}`; // the one a failover promotes
      await waitFor("the check to name the new replica", () => seen.length > 0, 5_000);
      assert.deepEqual(seen, [{ address: newNode, role: "replica" }]);
      await new Promise((r) => setTimeout(r, 600)); // three more rounds name it no more
      assert.equal(seen.length, 1);
      assert.equal(worker.exit, undefined, "a replica outside the set does not stop the process");
    });

    await t.step("the worker's own check warns about the new replica, naming it, and the worker goes on", async () => {
      // Its first round is SENTINEL_NODES_CHECK_MS (30 s) after it started.
      await waitFor("the worker's warning", () => worker.lines("redis_node_not_permitted").length > 0, 45_000);
      const lines = worker.lines("redis_node_not_permitted");
      assert.deepEqual(lines.map((line) => [line.level, line.role, line.node]), [["warn", "replica", newNode]]);
      assert.match(String(lines[0]!.message), /restart the process to grant it/);
      assert.equal(worker.exit, undefined);
    });

    await t.step("once it is promoted, the worker logs one error line naming it and exits 1", async () => {
      const promoted = await sentinel.failover();
      const promotedAt = performance.now();
      assert.equal(`127.0.0.1:${promoted}`, newNode, "the new replica was promoted");
      const exit = await waitFor("the worker to exit", () => worker.exit, 20_000);
      assert.equal(exit.code, 1, worker.stderr.slice(-800));
      const lines = worker.lines("redis_master_not_permitted");
      assert.equal(lines.length, 1, worker.stderr.slice(-800));
      assert.equal(lines[0]!.level, "error");
      assert.equal(lines[0]!.node, newNode);
      assert.equal(lines[0]!.service, sentinel.service);
      assert.match(String(lines[0]!.message), new RegExp(`${newNode}.*outside this process's --allow-net.*restart`));
      console.log(
        JSON.stringify({ worker_exit_after_promotion_ms: Math.round(exit.atMs - promotedAt), line: lines[0] }),
      );
    });

    await t.step("a process started after the promotion is granted the new master and works", async () => {
      const port = freePort();
      api = startTask("api", { ...env, PORT: String(port) });
      await waitFor("the api to be ready on the new master", async () => {
        if (api!.exit) throw new Error(`the api exited: ${api!.stderr.slice(-800)}`);
        const res = await fetch(`http://127.0.0.1:${port}/readyz`).catch(() => undefined);
        await res?.body?.cancel();
        return res?.status === 200;
      }, 20_000);
      const exit = await api.stop();
      assert.equal(exit.code, 0, api.stderr.slice(-800));
      assert.doesNotMatch(api.stderr, /NotCapable|not_permitted/);
    });
  } finally {
    await watch.stop();
    await worker.stop();
    await api?.stop();
    await db.close();
    await sentinel.stop();
  }
});
