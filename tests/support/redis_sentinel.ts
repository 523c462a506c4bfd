/**
 * Redis behind Sentinel for tests and the chaos run: in a temporary
 * directory, on free loopback ports, a primary with AOF, one replica, and
 * three sentinels (quorum 2, down after 1 s) monitoring it as one service.
 * It can SIGKILL the primary, wait until the sentinels promote the replica,
 * and bring the old primary back as a replica. About 3 s to start.
 */
import { Redis } from "ioredis";
import { sleep } from "../../src/async/timeout.ts";
import { freePort } from "./free_port.ts";

/** A running primary, replica and three sentinels. */
export interface RedisSentinel {
  /** `redis+sentinel://127.0.0.1:<s1>,127.0.0.1:<s2>,127.0.0.1:<s3>/<service>/0`, for REDIS_URL. */
  url: string;
  /** The monitored service's name (`SENTINEL MONITOR <service> ...`). */
  service: string;
  /** The port the primary was started on (the master until a failover). */
  primaryPort: number;
  /** The port the replica was started on (the master after one failover). */
  replicaPort: number;
  sentinelPorts: number[];
  /** The port the sentinels name as the master now, asked of the first sentinel that answers. */
  masterPort(): Promise<number>;
  /** SIGKILLs the current master's process (no shutdown, no final AOF write). @returns its port. */
  killPrimary(): Promise<number>;
  /**
   * Waits until every sentinel names a master other than the killed one.
   * @returns the new master's port and the milliseconds since the kill.
   * @throws {Error} after `timeoutMs`.
   */
  waitForFailover(timeoutMs?: number): Promise<{ port: number; afterKillMs: number }>;
  /**
   * Starts the killed master again on its port and files, as a replica of
   * the new master (the sentinels would reconfigure it anyway), and waits
   * until it has synced and the sentinels list it as a healthy replica.
   */
  restartOldPrimary(): Promise<void>;
  /**
   * Starts one more replica of the current master on a new free port, with
   * `priority` as its `replica-priority` (lower is promoted first; the
   * others have 100), and waits until every sentinel lists it as a healthy
   * replica (a sentinel finds it in the master's INFO, every 10 s).
   * @returns its port.
   */
  addReplica(options?: { priority?: number }): Promise<number>;
  /**
   * Asks a sentinel for a manual failover (`SENTINEL FAILOVER`, retried
   * while it is refused) and waits until every sentinel names a new master
   * that has taken the role.
   * @returns the new master's port.
   */
  failover(timeoutMs?: number): Promise<number>;
  /** SIGKILLs every process and removes the directory. */
  stop(): Promise<void>;
}

const LOCALHOST = "127.0.0.1";

async function until(what: string, check: () => Promise<boolean>, timeoutMs = 20_000): Promise<void> {
  const end = performance.now() + timeoutMs;
  while (!(await check().catch(() => false))) {
    if (performance.now() > end) throw new Error(`redis sentinel: timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(50);
  }
}

/** Runs `fn` on a one-off connection to `port` that never retries. */
async function on<T>(port: number, fn: (redis: Redis) => Promise<T>): Promise<T> {
  const redis = new Redis({
    host: LOCALHOST,
    port,
    lazyConnect: true,
    maxRetriesPerRequest: 0,
    retryStrategy: () => null,
    enableReadyCheck: false,
    connectTimeout: 1_000,
  });
  redis.on("error", () => {});
  try {
    await redis.connect();
    return await fn(redis);
  } finally {
    redis.disconnect();
  }
}

/** A flat `[field, value, ...]` reply as an object. */
function fields(reply: unknown): Record<string, string> {
  const list = reply as string[];
  const out: Record<string, string> = {};
  for (let i = 0; i + 1 < list.length; i += 2) out[list[i]!] = list[i + 1]!;
  return out;
}

/** Starts the primary, the replica and three sentinels, and waits until the sentinels agree and know each other. */
export async function startRedisSentinel({ service = "oncely" }: { service?: string } = {}): Promise<RedisSentinel> {
  const dir = await Deno.makeTempDir({ prefix: "oncely-sentinel-" });
  const primaryPort = freePort();
  const replicaPort = freePort();
  const sentinelPorts = [freePort(), freePort(), freePort()];
  const children = new Map<number, Deno.ChildProcess>();

  const spawn = (port: number, args: string[]) => {
    const child = new Deno.Command("redis-server", { args, cwd: dir, stdout: "null", stderr: "null" }).spawn();
    children.set(port, child);
  };
  const dataNode = (port: number, replicaOf?: number, extra: string[] = []) =>
    spawn(port, [
      "--port",
      String(port),
      "--bind",
      LOCALHOST,
      "--dir",
      dir,
      "--save",
      "",
      "--appendonly",
      "yes",
      "--appendfsync",
      "always",
      "--appenddirname",
      `aof-${port}`,
      "--dbfilename",
      `dump-${port}.rdb`,
      ...(replicaOf === undefined ? [] : ["--replicaof", LOCALHOST, String(replicaOf)]),
      ...extra,
    ]);
  const kill = async (port: number) => {
    const child = children.get(port);
    if (!child) return;
    children.delete(port);
    try {
      child.kill("SIGKILL");
    } catch { /* already gone */ }
    await child.status;
  };

  const stop = async () => {
    for (const port of [...children.keys()]) await kill(port);
    await Deno.remove(dir, { recursive: true }).catch(() => {});
  };

  try {
    dataNode(primaryPort);
    dataNode(replicaPort, primaryPort);
    await until(
      "the replica in sync",
      () => on(replicaPort, async (r) => /master_link_status:up/.test(await r.info("replication"))),
    );
    for (const port of sentinelPorts) {
      // A sentinel rewrites its own file (it records the replicas and the other sentinels it found).
      const conf = `${dir}/sentinel-${port}.conf`;
      await Deno.writeTextFile(
        conf,
        [
          `port ${port}`,
          `bind ${LOCALHOST}`,
          `dir ${dir}`,
          "sentinel resolve-hostnames no",
          "sentinel announce-hostnames no",
          `sentinel monitor ${service} ${LOCALHOST} ${primaryPort} 2`,
          `sentinel down-after-milliseconds ${service} 1000`,
          `sentinel failover-timeout ${service} 5000`,
          `sentinel parallel-syncs ${service} 1`,
          "",
        ].join("\n"),
      );
      spawn(port, [conf, "--sentinel"]);
    }
    // A failover needs a majority of sentinels that know each other (found through hello messages) and the replica.
    for (const port of sentinelPorts) {
      await until(
        `sentinel ${port} to know the master, the replica and the other sentinels`,
        () =>
          on(port, async (r) => {
            const master = fields(await r.call("SENTINEL", "MASTER", service));
            return master.port === String(primaryPort) && master["num-slaves"] === "1" &&
              master["num-other-sentinels"] === String(sentinelPorts.length - 1) && master.flags === "master";
          }),
      );
    }
  } catch (error) {
    await stop();
    throw error;
  }

  const masterSeen = (port: number) =>
    on(port, async (r) => Number((await r.call("SENTINEL", "GET-MASTER-ADDR-BY-NAME", service) as string[])[1]));
  const masterPort = async () => {
    for (const port of sentinelPorts) {
      const seen = await masterSeen(port).catch(() => undefined);
      if (seen) return seen;
    }
    throw new Error("redis sentinel: no sentinel answers");
  };
  let killed: { port: number; at: number } | undefined;
  const everySentinelNames = (what: string, master: (port: number) => boolean, timeoutMs = 20_000) =>
    until(what, async () => {
      const seen = await Promise.all(sentinelPorts.map(masterSeen));
      return seen.every((port) => port === seen[0] && master(port)) &&
        await on(seen[0]!, async (r) => (await r.role())[0] === "master");
    }, timeoutMs);

  return {
    url: `redis+sentinel://${sentinelPorts.map((p) => `${LOCALHOST}:${p}`).join(",")}/${service}/0`,
    service,
    primaryPort,
    replicaPort,
    sentinelPorts,
    masterPort,
    async killPrimary() {
      const port = await masterPort();
      await kill(port);
      killed = { port, at: performance.now() };
      return port;
    },
    async waitForFailover(timeoutMs = 20_000) {
      if (!killed) throw new Error("redis sentinel: waitForFailover() before killPrimary()");
      const old = killed.port;
      let promoted = 0;
      await until(`the sentinels to promote a new master after ${old} was killed`, async () => {
        const seen = await Promise.all(sentinelPorts.map(masterSeen));
        promoted = seen[0]!;
        if (!seen.every((port) => port === promoted && port !== old)) return false;
        // The new master has taken the role: it accepts writes.
        return await on(promoted, async (r) => (await r.role())[0] === "master");
      }, timeoutMs);
      return { port: promoted, afterKillMs: Math.round(performance.now() - killed.at) };
    },
    async restartOldPrimary() {
      if (!killed) throw new Error("redis sentinel: restartOldPrimary() before killPrimary()");
      const { port } = killed;
      const master = await masterPort();
      dataNode(port, master);
      killed = undefined;
      await until(`${port} back as a replica in sync with ${master}`, () =>
        on(port, async (r) => {
          const info = await r.info("replication");
          return /role:slave/.test(info) && new RegExp(`master_port:${master}\\b`).test(info) &&
            /master_link_status:up/.test(info);
        }));
      for (const sentinel of sentinelPorts) {
        await until(`sentinel ${sentinel} to list ${port} as a healthy replica`, () =>
          on(sentinel, async (r) => {
            const replicas = (await r.call("SENTINEL", "REPLICAS", service) as unknown[]).map(fields);
            return replicas.some((replica) => replica.port === String(port) && replica.flags === "slave");
          }));
      }
    },
    async addReplica({ priority = 100 } = {}) {
      const port = freePort();
      const master = await masterPort();
      dataNode(port, master, ["--replica-priority", String(priority)]);
      await until(
        `the new replica ${port} in sync`,
        () => on(port, async (r) => /master_link_status:up/.test(await r.info("replication"))),
      );
      for (const sentinel of sentinelPorts) {
        await until(`sentinel ${sentinel} to list the new replica ${port} as healthy`, () =>
          on(sentinel, async (r) => {
            const replicas = (await r.call("SENTINEL", "REPLICAS", service) as unknown[]).map(fields);
            return replicas.some((replica) =>
              replica.port === String(port) && replica.flags === "slave" &&
              replica["slave-priority"] === String(priority)
            );
          }), 30_000);
      }
      return port;
    },
    async failover(timeoutMs = 20_000) {
      const before = await masterPort();
      // Refused (NOGOODSLAVE) until the sentinel has seen a replica answer for a while.
      await until(
        "a failover a sentinel accepts",
        () => on(sentinelPorts[0]!, (r) => r.call("SENTINEL", "FAILOVER", service)).then(() => true),
        timeoutMs,
      );
      await everySentinelNames(`the sentinels to name a master other than ${before}`, (p) => p !== before, timeoutMs);
      return await masterPort();
    },
    stop,
  };
}
