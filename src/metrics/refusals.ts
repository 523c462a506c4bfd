/**
 * Refusals by tenant and minute: each `429` the API answers a tenant (over
 * its budget, or any other limit) is counted in Redis, so the console can
 * chart the last 24 hours of them, and in a Prometheus counter. One hash per
 * tenant and UTC hour ({@linkcode RefusalKeys}: in the tenant's slot, beside
 * its lane), with a field per status and minute of the hour (`429:17`), kept
 * 25 hours.
 * Recording is fire-and-forget: a refusal is never slowed or failed by its
 * own record.
 */
import { Counter, type Registry } from "prom-client";
import type { RedisClient } from "../clients.ts";

/** How long an hour's hash is kept: the console's 24 hours, and the hour in progress. */
export const REFUSALS_TTL_S = 25 * 3600;

const HOUR_MS = 3_600_000;
const MINUTE_MS = 60_000;

/**
 * The start of the oldest UTC hour whose refusals are all still kept at `nowMs`: an hour's hash lives
 * {@linkcode REFUSALS_TTL_S} from its last refusal, so at least that long from the hour's start. Older hours may
 * be gone, whole or in part.
 */
export function refusalsKeptFrom(nowMs: number): number {
  return (Math.floor(nowMs / HOUR_MS) + 1) * HOUR_MS - REFUSALS_TTL_S * 1000;
}

/** Where the refusals are kept: one hash per tenant and UTC hour, in the tenant's hash tag. */
export interface RefusalKeys {
  /** The hash of `tenant`'s refusals in UTC hour `hour` (hours since the epoch). */
  refusals(tenant: string, hour: number): string;
}

/**
 * Counts one refusal with `status` for `tenant` at `nowMs` in its minute's field, and renews the hash's expiry:
 * one pipelined round trip that the caller does not wait for (a failure is dropped). Not safe to run twice: a resend
 * after a lost reply counts the refusal twice in the console's chart. That is left so: the chart decides nothing, and
 * naming each refusal would cost a key per 429, which a flood of them would turn into memory.
 */
export function recordRefusal(
  redis: RedisClient,
  keys: RefusalKeys,
  tenant: string,
  status: number,
  nowMs: number = Date.now(),
): Promise<void> {
  const key = keys.refusals(tenant, Math.floor(nowMs / HOUR_MS));
  return redis.pipeline()
    .hincrby(key, `${status}:${Math.floor((nowMs % HOUR_MS) / MINUTE_MS)}`, 1)
    .expire(key, REFUSALS_TTL_S)
    .exec()
    .then(() => {}, () => {});
}

/**
 * `tenant`'s refusals with `status` in each minute from `fromMs` to `toMs`, by minute (minutes since the epoch;
 * minutes without any are absent): one HGETALL per UTC hour, pipelined in the tenant's slot.
 */
export async function refusalsPerMinute(
  redis: RedisClient,
  keys: RefusalKeys,
  tenant: string,
  { status = 429, fromMs, toMs }: { status?: number; fromMs: number; toMs: number },
): Promise<Map<number, number>> {
  const first = Math.floor(fromMs / HOUR_MS), last = Math.floor((toMs - 1) / HOUR_MS);
  const pipeline = redis.pipeline();
  for (let h = first; h <= last; h++) pipeline.hgetall(keys.refusals(tenant, h));
  const replies = (await pipeline.exec()) ?? [];
  const minutes = new Map<number, number>();
  replies.forEach(([error, fields], i) => {
    if (error) throw error;
    for (const [field, value] of Object.entries(fields as Record<string, string>)) {
      const [s, m] = field.split(":");
      const minute = (first + i) * 60 + Number(m);
      if (s !== String(status) || minute * MINUTE_MS < fromMs || minute * MINUTE_MS >= toMs) continue;
      minutes.set(minute, (minutes.get(minute) ?? 0) + Number(value));
    }
  });
  return minutes;
}

/** How many tenants get a series of their own in `oncely_tenant_refusals_total`; the rest count as "other". */
export const REFUSAL_SERIES_TENANTS = 100;

/** Counts a tenant's refusals by status. */
export type RefusalCounter = (tenant: string, status: number) => void;

const counters = new WeakMap<Registry, RefusalCounter>();

/**
 * `oncely_tenant_refusals_total{tenant, status}` in `registry`, registered once however often it is asked for.
 * Its labels stay bounded: the first {@linkcode REFUSAL_SERIES_TENANTS} tenants refused get their own series,
 * any later one counts under `tenant="other"` (the console's chart, from Redis, has every tenant).
 */
export function refusalCounter(registry: Registry): RefusalCounter {
  let count = counters.get(registry);
  if (!count) {
    const counter = new Counter({
      name: "oncely_tenant_refusals_total",
      help: "Requests the API refused a tenant with 429 (over its budget, or another limit), by tenant and status; " +
        `tenants beyond the first ${REFUSAL_SERIES_TENANTS} refused are counted as "other".`,
      labelNames: ["tenant", "status"] as const,
      registers: [registry],
    });
    const named = new Set<string>();
    count = (tenant, status) => {
      if (!named.has(tenant) && named.size < REFUSAL_SERIES_TENANTS) named.add(tenant);
      counter.inc({ tenant: named.has(tenant) ? tenant : "other", status: String(status) });
    };
    counters.set(registry, count);
  }
  return count;
}
