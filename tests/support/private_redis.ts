/**
 * A `redis-server` of a test's own on a free loopback port (no persistence), for tests that count the commands
 * the server ran (`INFO commandstats`): on the shared Redis, other test runs' commands would be counted too.
 */
import { Redis } from "ioredis";
import { freePort } from "./free_port.ts";

/** A running private server and a client of it. */
export interface PrivateRedis {
  url: string;
  redis: Redis;
  /** Calls of each command since the last `resetStats` (`INFO commandstats`), without the INFO and CONFIG asked. */
  commands(): Promise<Map<string, { calls: number; usec: number }>>;
  resetStats(): Promise<void>;
  stop(): Promise<void>;
}

/** Starts a server and waits until it answers. */
export async function startPrivateRedis(): Promise<PrivateRedis> {
  const dir = await Deno.makeTempDir({ prefix: "oncely-private-redis-" });
  const port = freePort();
  const child = new Deno.Command("redis-server", {
    args: ["--port", String(port), "--bind", "127.0.0.1", "--dir", dir, "--save", "", "--appendonly", "no"],
    stdout: "null",
    stderr: "null",
  }).spawn();
  const url = `redis://127.0.0.1:${port}`;
  const redis = new Redis(url, {
    lazyConnect: true,
    maxRetriesPerRequest: 1,
    retryStrategy: (n) => Math.min(n, 20) * 25,
  });
  redis.on("error", () => {});
  const end = performance.now() + 10_000;
  for (;;) {
    try {
      await redis.connect();
      await redis.ping();
      break;
    } catch (error) {
      if (performance.now() > end) {
        child.kill("SIGKILL");
        await child.status;
        throw error;
      }
      redis.disconnect();
      await new Promise((r) => setTimeout(r, 50));
    }
  }
  return {
    url,
    redis,
    async commands() {
      const out = new Map<string, { calls: number; usec: number }>();
      for (const line of (await redis.info("commandstats")).split("\r\n")) {
        const m = /^cmdstat_([^:]+):calls=(\d+),usec=(\d+)/.exec(line);
        if (m && m[1] !== "info" && m[1] !== "config|resetstat") {
          out.set(m[1]!, { calls: Number(m[2]), usec: Number(m[3]) });
        }
      }
      return out;
    },
    async resetStats() {
      await redis.config("RESETSTAT");
    },
    async stop() {
      await redis.quit().catch(() => redis.disconnect());
      child.kill("SIGKILL");
      await child.status;
      await Deno.remove(dir, { recursive: true });
    },
  };
}
