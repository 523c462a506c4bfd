import type { RedisClient } from "./client.ts";
import { createHash } from "node:crypto";

/** A Lua script run by SHA, loaded into the server only when it is missing. */
export interface Script {
  readonly sha: string;
  /** The body, for EVAL when the server does not have it (NOSCRIPT). */
  readonly lua: string;
  /** Runs the script with EVALSHA, falling back to EVAL once on NOSCRIPT. */
  run(redis: RedisClient, keys: string[], args: (string | number)[]): Promise<unknown>;
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
    lua,
    run(redis, keys, args) {
      return redis.evalsha(sha, keys.length, ...keys, ...args).catch((error) => {
        if (!(error instanceof Error) || !error.message.startsWith("NOSCRIPT")) throw error;
        return redis.eval(lua, keys.length, ...keys, ...args);
      });
    },
  };
}
