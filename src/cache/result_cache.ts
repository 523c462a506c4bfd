/**
 * The result cache: a done run's output, reused by a later run of the same
 * tenant, task version, definition, model and input within the TTL (the
 * version's `cache_ttl_s`, else `RESULT_CACHE_TTL_S`; 0 = off), with no
 * model call.
 *
 * Entries live in Redis under the tenant's hash tag (`{t:<tenant>}`), so every
 * step is one script in one Redis Cluster slot, and a tenant only ever reads
 * its own (the tenant is part of the hashed key, too). Two identical runs in
 * flight make one model call between them: the first to miss holds the
 * entry's lock (a lease, renewed while it runs) and fills the entry when it
 * commits `done`; the others poll for the entry and take the lock over when
 * its holder ends without filling it (failed, cancelled, crashed).
 */
import { JobDeferred } from "../queue/errors.ts";
import { z } from "zod";
import type { RedisClient } from "../clients.ts";
import { sha256Hex } from "../crypto/digest.ts";
import { canonicalJson } from "../idempotency/fingerprint.ts";
import type { Logger } from "../log/logger.ts";
import { costNanos, nanosToUsd, type Prices } from "../llm/prices.ts";
import { type Clock, systemClock } from "../retry/clock.ts";
import type { Deadline } from "../retry/deadline.ts";
import type { CacheHit } from "./cache_hit_store.ts";
import { CLAIM_SCRIPT } from "./claim_script.ts";
import { FILL_SCRIPT } from "./fill_script.ts";
import { LEASE_SCRIPT } from "./lease_script.ts";

/** Defaults of the optional {@linkcode ResultCacheOptions}. */
export const RESULT_CACHE_DEFAULTS = {
  /**
   * The lease of an entry's lock. Its holder renews it every third of it while it runs, so it only lapses when
   * the holder's process died: that is how long waiters wait for a crashed holder before one takes over.
   */
  leaseMs: 10_000,
  /** A waiter's first pause between looks at the entry; each pause doubles, up to `pollMaxMs`. */
  pollMinMs: 20,
  pollMaxMs: 500,
} as const;

/** A cache entry as stored: the done run it came from, its output and model, and the tokens its calls used. */
const CacheEntry = z.object({
  source_run_id: z.string(),
  output: z.unknown(),
  model: z.string().nullable(),
  prompt_tokens: z.number().int().min(0),
  completion_tokens: z.number().int().min(0),
});
type CacheEntry = z.infer<typeof CacheEntry>;

/** What the cache reports, for metrics. */
export interface ResultCacheEvents {
  /** A lookup found the entry (`hit`), or did not and the run makes the call itself (`miss`). */
  lookup?(tenant: string, result: "hit" | "miss"): void;
}

/**
 * The Redis keys of one tenant's cache entries, by their key's hash (`cacheKeyHash`): the entry and the lock of the
 * one run computing it (in-flight dedupe). Both must share the tenant's hash tag, so each script is in one slot.
 */
export interface CacheKeys {
  entry(keyHash: string): string;
  lock(keyHash: string): string;
}

/** The longest an entry is kept, whatever a task's `cache_ttl_s` says: a year. */
const MAX_TTL_S = 365 * 24 * 3600;

/** Options for {@linkcode createResultCache}. */
export interface ResultCacheOptions {
  /** RESULT_CACHE_TTL_S: the TTL of runs whose task version sets no `cache_ttl_s` (summaries too); 0 = off. */
  defaultTtlS: number;
  /** Prices a hit's saved tokens (`cache_hits.saved_usd`); without one, it is null. */
  prices?: Prices;
  events?: ResultCacheEvents;
  leaseMs?: number;
  pollMinMs?: number;
  pollMaxMs?: number;
  clock?: Clock;
}

/** One run, as the cache keys it. */
export interface CacheableRun {
  tenant: string;
  runId: string;
  task: string;
  version: number;
  /** The model the run asks. */
  model: string;
  /**
   * The task version's definition (prompt, system, models, schemas, output cap...): a digest of it is part of
   * the key. A tenant's version never changes, but the built-in `summarize` is version 1 in every release: a
   * release that changes its prompt must miss, not serve the old prompt's results for up to a year. Unset (a
   * caller that has none) counts as one definition of its own.
   */
  definition?: unknown;
  input: unknown;
  /** The task version's `cache_ttl_s`, if it sets one. */
  ttlS?: number;
  /** `Cache-Control: no-cache` on its POST: no lookup (a done result is still stored). */
  noCache: boolean;
}

/** What a lookup came to: a hit (the source's output and what reusing it saved), or a miss. */
export type Claim =
  | {
    hit: CacheHit;
    output: unknown;
    /** Whether the run waited for another run in flight to compute it (in-flight dedupe). */
    waited: boolean;
  }
  | {
    hit?: undefined;
    /** Whether this run now holds the entry's lock (the others wait for its result). */
    held: boolean;
    /** Whether it waited for another run's result first (which then did not come). */
    waited: boolean;
  };

/** The cache as one run sees it. */
export interface RunCache {
  /** Whether the run looks the cache up (not with `Cache-Control: no-cache`). */
  readonly lookup: boolean;
  /**
   * Looks the entry up; on a miss, takes its lock, or waits while another run holds it: until the entry is
   * there (a hit) or the lock is free (a miss, holding it).
   * @throws {DeadlineExceeded} when `deadline` passes while waiting, or the signal's reason when it aborts.
   * @throws the Redis client's error when Redis does not answer.
   */
  claim(signal: AbortSignal, deadline: Deadline): Promise<Claim>;
  /**
   * Stores the run's result once it committed `done`, and ends its lock. Best effort: a failure is logged,
   * never thrown (the run is done whatever the cache says).
   */
  fill(
    result: { output: unknown; model: string | null; promptTokens: number; completionTokens: number },
  ): Promise<void>;
  /** Ends the run's lock if it holds it (and has not filled the entry). Best effort; safe to call twice. */
  release(): Promise<void>;
}

/** The result cache of a worker. */
export interface ResultCache {
  /** The run's view of the cache; undefined when the cache is off for it (a TTL of 0): then it costs nothing. */
  forRun(run: CacheableRun): RunCache | undefined;
}

/** Creates the result cache over `redis`; `keys` names a tenant's entries (in the tenant's hash tag). */
export function createResultCache(
  { redis, log }: { redis: RedisClient; log: Logger },
  { keys, ...options }: ResultCacheOptions & { keys: (tenant: string) => CacheKeys },
): ResultCache {
  const leaseMs = options.leaseMs ?? RESULT_CACHE_DEFAULTS.leaseMs;
  const pollMinMs = options.pollMinMs ?? RESULT_CACHE_DEFAULTS.pollMinMs;
  const pollMaxMs = options.pollMaxMs ?? RESULT_CACHE_DEFAULTS.pollMaxMs;
  const clock = options.clock ?? systemClock;

  const savedUsd = (model: string | null, prompt: number, completion: number): number | null => {
    const price = model === null ? undefined : options.prices?.of(model);
    return price ? nanosToUsd(costNanos(price, prompt, completion)) : null;
  };

  return {
    forRun(run) {
      // At most a year (RESULT_CACHE_TTL_S's own bound): a task's cache_ttl_s has none, and PX must stay an integer.
      const ttlS = Math.min(run.ttlS ?? options.defaultTtlS, MAX_TTL_S);
      if (!(ttlS > 0)) return undefined;
      const hash = cacheKeyHash(run);
      const tenantKeys = keys(run.tenant);
      const entryKey = tenantKeys.entry(hash);
      const lockKey = tenantKeys.lock(hash);
      const ctx = { tenant: run.tenant, job_id: run.runId, task: run.task };
      let renewal: ReturnType<typeof setInterval> | undefined;
      let holding = false;

      const hold = () => {
        holding = true;
        // The lease lapses only if this process dies: a live holder keeps it however long its call waits.
        renewal = setInterval(() => {
          LEASE_SCRIPT.run(redis, [lockKey], [run.runId, leaseMs]).then((held) => {
            if (held === 0) stopHolding();
          }, (error) => log.debug("result_cache_renew_failed", { ...ctx, error }));
        }, Math.max(1, Math.floor(leaseMs / 3)));
        Deno.unrefTimer(renewal);
      };
      const stopHolding = () => {
        holding = false;
        clearInterval(renewal);
        renewal = undefined;
      };

      return {
        lookup: !run.noCache,
        async claim(signal, deadline) {
          let pauseMs = pollMinMs;
          let waited = false;
          for (;;) {
            const found = await CLAIM_SCRIPT.run(redis, [entryKey, lockKey], [run.runId, leaseMs]);
            if (typeof found === "string") {
              const entry = parseEntry(found);
              if (entry) {
                options.events?.lookup?.(run.tenant, "hit");
                const hit: CacheHit = {
                  sourceRunId: entry.source_run_id,
                  model: entry.model,
                  promptTokens: entry.prompt_tokens,
                  completionTokens: entry.completion_tokens,
                  savedUsd: savedUsd(entry.model, entry.prompt_tokens, entry.completion_tokens),
                };
                return { hit, output: entry.output, waited };
              }
              // Not an entry this release can read: the run computes its own result (and stores it over it).
              log.warn("result_cache_entry_unreadable", ctx);
              options.events?.lookup?.(run.tenant, "miss");
              return { held: false, waited };
            }
            if (found === 1) {
              hold();
              options.events?.lookup?.(run.tenant, "miss");
              return { held: true, waited };
            }
            // Another run computes this entry: look again after a pause, within this delivery's deadline.
            waited = true;
            const left = deadline.remaining();
            // Still held by a live run after this delivery's whole budget (its call waits for a permit, a pause, a
            // budget): back to the end of the lane, spending no delivery, rather than failing as a run that timed out.
            if (left <= 0) throw new JobDeferred("still waiting for an identical run's result (its call is in flight)");
            await clock.sleep(Math.min(pauseMs, left), signal);
            pauseMs = Math.min(pauseMs * 2, pollMaxMs);
          }
        },
        async fill({ output, model, promptTokens, completionTokens }) {
          const entry: CacheEntry = {
            source_run_id: run.runId,
            output,
            model,
            prompt_tokens: promptTokens,
            completion_tokens: completionTokens,
          };
          stopHolding();
          try {
            await FILL_SCRIPT.run(redis, [entryKey, lockKey], [JSON.stringify(entry), ttlS * 1000, run.runId]);
          } catch (error) {
            // The run is done; without the entry, the next identical run calls the model. Its lock ends with its
            // lease (waiters take over then).
            log.warn("result_cache_fill_failed", { ...ctx, error });
          }
        },
        async release() {
          if (!holding) return;
          stopHolding();
          try {
            await LEASE_SCRIPT.run(redis, [lockKey], [run.runId, 0]);
          } catch (error) {
            log.warn("result_cache_release_failed", { ...ctx, error });
          }
        },
      };
    },
  };
}

/**
 * What names a run's cache entry: the hash of its tenant, task, version, definition's digest, model and input,
 * the input in canonical JSON (key-order independent: equal inputs hash equally however the client spelled them).
 */
export function cacheKeyHash(
  run: Pick<CacheableRun, "tenant" | "task" | "version" | "definition" | "model" | "input">,
): string {
  const digest = definitionDigest(run.definition);
  return sha256Hex(canonicalJson([run.tenant, run.task, run.version, digest, run.model, run.input]));
}

/** Digests of definitions seen, by object: a task version is loaded once and kept, so each is hashed once. */
const digests = new WeakMap<object, string>();

/**
 * SHA-256 of a task definition in canonical JSON (equal definitions digest equally, whatever their key order);
 * null for none.
 */
export function definitionDigest(definition: unknown): string | null {
  if (definition === undefined) return null;
  if (definition === null || typeof definition !== "object") return sha256Hex(canonicalJson(definition));
  let digest = digests.get(definition);
  if (digest === undefined) {
    digest = sha256Hex(canonicalJson(definition));
    digests.set(definition, digest);
  }
  return digest;
}

function parseEntry(text: string): CacheEntry | undefined {
  try {
    const parsed = CacheEntry.safeParse(JSON.parse(text));
    return parsed.success ? parsed.data : undefined;
  } catch {
    return undefined;
  }
}

/**
 * Whether a request's `Cache-Control` header says `no-cache` (a directive of the comma-separated list, in any
 * case): the run then skips the lookup.
 */
export function skipsCache(headers: Headers): boolean {
  const value = headers.get("cache-control");
  if (value === null) return false;
  return value.split(",").some((d) => d.trim().split("=")[0]!.trim().toLowerCase() === "no-cache");
}
