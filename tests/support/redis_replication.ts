/**
 * A local Redis primary with one replica, for the REDIS_MIN_REPLICAS_ACK
 * tests and measurements: two `redis-server` processes on free loopback
 * ports in a temporary directory, no persistence. About 1 s to start.
 */
import { Redis } from "ioredis";
import { sleep } from "../../src/async/timeout.ts";
import { freePort } from "./free_port.ts";

/** A running primary and replica. */
export interface LocalReplication {
  /** `redis://127.0.0.1:<port>` of the primary. */
  primary: string;
  /** `redis://127.0.0.1:<port>` of the replica. */
  replica: string;
  /** SIGSTOP: the replica stays connected but acknowledges nothing, as a stalled host would. */
  pause(): void;
  /** SIGCONT after `pause`, then waits until the replica has caught up. */
  resume(): Promise<void>;
  /** SIGKILLs the replica (it keeps nothing: no persistence). */
  killReplica(): Promise<void>;
  /** Starts the replica again (`--replicaof` the primary) and waits until it is in sync. */
  startReplica(): Promise<void>;
  stop(): Promise<void>;
}

async function until(what: string, check: () => Promise<boolean>, timeoutMs = 15_000): Promise<void> {
  const end = performance.now() + timeoutMs;
  while (!(await check().catch(() => false))) {
    if (performance.now() > end) throw new Error(`local replication: timed out waiting for ${what}`);
    await sleep(25);
  }
}

async function ask<T>(port: number, question: (redis: Redis) => Promise<T>): Promise<T> {
  const redis = new Redis({
    host: "127.0.0.1",
    port,
    lazyConnect: true,
    maxRetriesPerRequest: 0,
    retryStrategy: () => null,
  });
  redis.on("error", () => {});
  try {
    await redis.connect();
    return await question(redis);
  } finally {
    redis.disconnect();
  }
}

/** Starts a primary and its replica, in sync when this returns. */
export async function startLocalReplication(): Promise<LocalReplication> {
  const dir = await Deno.makeTempDir({ prefix: "oncely-replication-" });
  const [primaryPort, replicaPort] = [freePort(), freePort()];
  const spawn = (port: number, extra: string[]) =>
    new Deno.Command("redis-server", {
      args: ["--port", String(port), "--bind", "127.0.0.1", "--dir", dir, "--save", "", "--appendonly", "no", ...extra],
      stdout: "null",
      stderr: "null",
    }).spawn();
  const primary = spawn(primaryPort, []);
  let replica: Deno.ChildProcess | undefined;
  const inSync = () =>
    until("the replica in sync", async () => {
      const info = await ask(primaryPort, (r) => r.info("replication"));
      const line = /slave0:([^\r\n]*)/.exec(info)?.[1] ?? "";
      const offset = Number(/master_repl_offset:(\d+)/.exec(info)?.[1]);
      return /state=online/.test(line) && Number(/offset=(\d+)/.exec(line)?.[1]) >= offset;
    });
  const startReplica = async () => {
    replica = spawn(replicaPort, ["--replicaof", "127.0.0.1", String(primaryPort)]);
    await inSync();
  };
  try {
    await until("the primary", () => ask(primaryPort, async (r) => (await r.ping()) === "PONG"));
    await startReplica();
  } catch (error) {
    for (const child of [primary, replica]) child?.kill("SIGKILL");
    throw error;
  }
  const signal = (name: Deno.Signal) => replica!.kill(name);
  return {
    primary: `redis://127.0.0.1:${primaryPort}`,
    replica: `redis://127.0.0.1:${replicaPort}`,
    pause: () => signal("SIGSTOP"),
    async resume() {
      signal("SIGCONT");
      await inSync();
    },
    async killReplica() {
      signal("SIGKILL");
      await replica!.status;
    },
    startReplica,
    async stop() {
      for (const child of [primary, replica!]) {
        try {
          child.kill("SIGCONT");
          child.kill("SIGKILL");
        } catch { /* gone */ }
        await child.status;
      }
      await Deno.remove(dir, { recursive: true });
    },
  };
}
