import type { ChainableCommander, Redis } from "ioredis";
import { createHash } from "node:crypto";

/** A Lua script run by SHA, loaded into the server only when it is missing. */
export interface Script {
  readonly sha: string;
  /** Runs the script with EVALSHA, falling back to EVAL once on NOSCRIPT. */
  run(redis: Redis, keys: string[], args: (string | number)[]): Promise<unknown>;
  /** Queues the script on a pipeline or MULTI (the caller handles NOSCRIPT by preloading with {@linkcode Script.load}). */
  queue(pipeline: ChainableCommander, keys: string[], args: (string | number)[]): void;
  /** Loads the script into a server, so that pipelined EVALSHA calls find it. */
  load(redis: Redis): Promise<void>;
}

/**
 * Defines a Lua script. The body is sent to Redis once per server (on the
 * first NOSCRIPT), not with every call. Every key a script touches must be
 * passed in `keys` and share one hash tag, so it runs on Redis Cluster too.
 */
export function defineScript(lua: string): Script {
  const sha = createHash("sha1").update(lua).digest("hex");
  return {
    sha,
    async run(redis, keys, args) {
      try {
        return await redis.evalsha(sha, keys.length, ...keys, ...args);
      } catch (error) {
        if (!(error instanceof Error) || !error.message.startsWith("NOSCRIPT")) throw error;
        return await redis.eval(lua, keys.length, ...keys, ...args);
      }
    },
    queue(pipeline, keys, args) {
      pipeline.evalsha(sha, keys.length, ...keys, ...args);
    },
    async load(redis) {
      await redis.script("LOAD", lua);
    },
  };
}
