import { sha256Hex } from "../crypto/digest.ts";
import type { Redis } from "ioredis";
import type { Logger } from "../log/logger.ts";
import { defineScript } from "../redis/script.ts";
import { KeyReused, RequestInProgress } from "./errors.ts";

/** A response worth remembering for replays. */
export interface StoredResponse {
  status: number;
  body: unknown;
  headers?: Record<string, string>;
}

/** The outcome of {@linkcode IdempotencyStore.run}. */
export interface IdempotentResult {
  response: StoredResponse;
  replayed: boolean;
}

/** Options for {@linkcode createIdempotencyStore}. */
export interface IdempotencyOptions {
  /** Redis key prefix, e.g. `oncely`. */
  prefix: string;
  /** Lifetime of the in-progress marker: the crash-recovery time. Set it above the slowest normal request. */
  lockTtlS: number;
  /** How long a finished response is replayed. */
  resultTtlS: number;
}

/** Runs a handler at most once per scope and replays its response. */
export interface IdempotencyStore {
  /**
   * Runs `handler` if this is the first request for `scope`; otherwise
   * replays the stored response.
   * @throws {RequestInProgress} while the first request is still running.
   * @throws {KeyReused} if the scope was used with another fingerprint.
   */
  run(scope: string, fingerprint: string, handler: () => Promise<StoredResponse>): Promise<IdempotentResult>;
  /** The Redis key that holds a scope's record. */
  keyFor(scope: string): string;
}

type Marker = { state: "in_progress"; fp: string; token: string };
type Done = { state: "done"; fp: string } & StoredResponse;

// Both scripts act only if the key still holds *our* exact marker. Without
// this guard a request that overran its lock TTL would overwrite, or delete,
// the record of the newer request that took the key after it expired.
const FINALISE = defineScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0`);
const RELEASE = defineScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0`);

/** Creates an {@linkcode IdempotencyStore} on Redis. */
export function createIdempotencyStore(
  { redis, log }: { redis: Redis; log: Logger },
  options: IdempotencyOptions,
): IdempotencyStore {
  // The scope is hashed so that the Redis key has a bounded length and no
  // caller-chosen characters; scopes are already collision-free encodings.
  const keyFor = (scope: string) => `${options.prefix}:idem:${sha256Hex(scope)}`;

  const release = async (key: string, marker: string) => {
    try {
      await RELEASE.run(redis, [key], [marker]);
    } catch (error) {
      // The marker then expires after lockTtlS; duplicates get 409 until then.
      log.warn("idempotency_release_failed", { key, error });
    }
  };

  return {
    keyFor,
    async run(scope, fingerprint, handler) {
      const key = keyFor(scope);
      const marker = JSON.stringify(
        { state: "in_progress", fp: fingerprint, token: crypto.randomUUID() } satisfies Marker,
      );
      // SET NX GET: take the key, or read who holds it, in one atomic step.
      const previous = await redis.call("SET", key, marker, "EX", options.lockTtlS, "NX", "GET") as string | null;
      if (previous !== null) {
        const record = JSON.parse(previous) as Marker | Done;
        if (record.fp !== fingerprint) throw new KeyReused();
        if (record.state === "in_progress") throw new RequestInProgress();
        const { status, body, headers } = record;
        return { response: { status, body, headers }, replayed: true };
      }

      let response: StoredResponse;
      try {
        response = await handler();
      } catch (error) {
        await release(key, marker);
        throw error;
      }
      if (response.status >= 500) {
        // Never store a failure: the client may retry with the same key.
        await release(key, marker);
        return { response, replayed: false };
      }
      const done = JSON.stringify({ state: "done", fp: fingerprint, ...response } satisfies Done);
      const stored = await FINALISE.run(redis, [key], [marker, done, options.resultTtlS]);
      if (stored !== 1) log.warn("idempotency_lock_lost", { key, lock_ttl_s: options.lockTtlS });
      return { response, replayed: false };
    },
  };
}
