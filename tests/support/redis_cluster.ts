/**
 * A local three-master Redis Cluster for tests and the chaos run:
 * `redis-server --cluster-enabled yes` on three free loopback ports in a
 * temporary directory, joined with `redis-cli --cluster create`. About 2 s.
 */
import { Redis } from "ioredis";
import { sleep } from "../../src/async/timeout.ts";
import { freePort } from "./free_port.ts";

/** A running cluster. */
export interface LocalCluster {
  /** `redis://127.0.0.1:<port>` of each master. */
  nodes: string[];
  /** Stops a node's process (SIGKILL) and starts it again on the same port and files. */
  restart(index: number): Promise<void>;
  stop(): Promise<void>;
}

async function until(what: string, check: () => Promise<boolean>, timeoutMs = 15_000): Promise<void> {
  const end = performance.now() + timeoutMs;
  while (!(await check().catch(() => false))) {
    if (performance.now() > end) throw new Error(`local cluster: timed out waiting for ${what}`);
    await sleep(50);
  }
}

async function answers(port: number, check: (redis: Redis) => Promise<boolean>): Promise<boolean> {
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
    return await check(redis);
  } finally {
    redis.disconnect();
  }
}

/** Starts a three-master cluster; `aof` turns on appendonly with fsync always (for crash tests). */
export async function startLocalCluster({ aof = false }: { aof?: boolean } = {}): Promise<LocalCluster> {
  const dir = await Deno.makeTempDir({ prefix: "oncely-cluster-" });
  const ports = [freePort(), freePort(), freePort()];
  const children = new Map<number, Deno.ChildProcess>();
  const spawn = (port: number) => {
    const child = new Deno.Command("redis-server", {
      args: [
        "--port",
        String(port),
        "--bind",
        "127.0.0.1",
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        `nodes-${port}.conf`,
        "--cluster-node-timeout",
        "2000",
        "--dir",
        dir,
        "--save",
        "",
        "--appendonly",
        aof ? "yes" : "no",
        "--appendfsync",
        "always",
        "--appendfilename",
        `appendonly-${port}.aof`,
        "--appenddirname",
        `aof-${port}`,
      ],
      stdout: "null",
      stderr: "null",
    }).spawn();
    children.set(port, child);
  };
  for (const port of ports) spawn(port);
  for (const port of ports) await until(`node ${port}`, () => answers(port, async (r) => (await r.ping()) === "PONG"));
  const create = await new Deno.Command("redis-cli", {
    args: ["--cluster", "create", ...ports.map((p) => `127.0.0.1:${p}`), "--cluster-replicas", "0", "--cluster-yes"],
    stdout: "piped",
    stderr: "piped",
  }).output();
  if (!create.success) throw new Error(`redis-cli --cluster create failed: ${new TextDecoder().decode(create.stderr)}`);
  const ok = (port: number) => answers(port, async (r) => /cluster_state:ok/.test(await r.cluster("INFO") as string));
  for (const port of ports) await until(`cluster state ok on ${port}`, () => ok(port));
  return {
    nodes: ports.map((p) => `redis://127.0.0.1:${p}`),
    async restart(index) {
      const port = ports[index]!;
      children.get(port)!.kill("SIGKILL");
      await children.get(port)!.status;
      spawn(port);
      await until(`node ${port} back`, () => ok(port));
    },
    async stop() {
      for (const child of children.values()) {
        try {
          child.kill("SIGKILL");
        } catch { /* gone */ }
        await child.status;
      }
      await Deno.remove(dir, { recursive: true });
    },
  };
}
