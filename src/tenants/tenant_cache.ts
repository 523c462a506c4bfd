/**
 * A cache of what the API reads from Postgres per tenant (or per API key) on
 * every request: whether a tenant is active, a key's row, a tenant's allow
 * lists, whether it has a webhook secret. Its cost per request is the same
 * with one tenant as with 20,000 (issue 39):
 *
 * - It is bounded by an estimate of its bytes ({@linkcode TenantMap}), not by a
 *   count of entries: {@linkcode TENANT_CACHE_BYTES} holds some 70,000
 *   tenants' flags, where a cap of 10,000 entries thrashed at 20,000 tenants
 *   and sent about every other request to Postgres.
 * - The entries in use are read again in bulk, a query per
 *   {@linkcode READ_CHUNK} keys, every half `ttlMs` while any is used, so no
 *   request waits for its tenant's entry to be read again once warm (a read
 *   per tenant per TTL was 2,000 queries a second at 20,000 tenants). An entry
 *   not used across {@linkcode IDLE_REFRESHES} of those reads is dropped, so
 *   the cache holds the tenants in use, not every tenant ever seen. In a
 *   process, a timer starts them too when no request comes (`signal`), so a
 *   pause in traffic does not leave every entry too old; without it, the first
 *   request to find its entry too old starts the bulk read of them all.
 * - Keys missed together (a cold start, new tenants) are read together: a
 *   read goes at once, and those missed while it is in flight follow in one
 *   read. Bulk reads go beside these, one at a time, and never hold them up.
 *
 * What it promises is unchanged by that: every value it answers with comes
 * from a read sent less than `ttlMs` before, so a change in Postgres (a
 * revoked key, a changed list) takes effect within `ttlMs`. A key the read did
 * not find (an unknown id, a tenant with no active key) is cached apart, in
 * its own bound ({@linkcode ABSENT_CACHE_BYTES}), and never read in bulk: a
 * flood of invented keys costs at most a query per key per `ttlMs`, fills only
 * that part, and never evicts a key in use.
 */
import { TenantMap } from "./tenant_map.ts";

/**
 * The most bytes (estimated: `tenant_map.ts`) of found entries one cache holds by default: about 70,000 tenants'
 * flags or empty allow lists (some 120 bytes each).
 */
export const TENANT_CACHE_BYTES = 8 * 1024 * 1024;
/** The most bytes (estimated) of keys found absent one cache holds by default: about 30,000 unknown ids or names. */
export const ABSENT_CACHE_BYTES = 4 * 1024 * 1024;
/** Keys read in one query. */
export const READ_CHUNK = 1_000;
/** An entry not used across this many bulk reads (each half a TTL apart: a minute at 10 s) is dropped, not read. */
export const IDLE_REFRESHES = 12;

/** One cached read: `value` undefined when the read found nothing for the key. */
export interface Cached<V> {
  readonly value: V | undefined;
}

interface Entry<V> extends Cached<V> {
  value: V | undefined;
  /** When the read that found it was sent (the cache's clock). */
  readAt: number;
  /** Bulk reads since its last use. */
  idle: number;
}

/** Options for {@linkcode createTenantCache}. */
export interface TenantCacheOptions<V> {
  /** Reads the current values of `keys` in one query: each key found, with its value; a key left out was not. */
  read(keys: string[]): Promise<Map<string, V>>;
  /** How old a read may be and still answer: a change in Postgres takes effect within this. */
  ttlMs: number;
  /** A value's estimate in bytes beyond its key (see `tenant_map.ts`); 0 when unset. */
  weigh?: (value: V) => number;
  /** The bound of found entries; {@linkcode TENANT_CACHE_BYTES} when unset. */
  maxBytes?: number;
  /** The bound of keys found absent; {@linkcode ABSENT_CACHE_BYTES} when unset, 0 to read such a key each time. */
  absentBytes?: number;
  /** The value kept when a found key is read again (the authenticator keeps the key it verified); the new one when unset. */
  merge?: (before: V, after: V) => V;
  /**
   * A process's lifetime: until it aborts, a timer also starts the bulk reads when no request does, so that a
   * pause in traffic longer than `ttlMs` does not leave every entry too old for the first requests after it
   * (entries idle across {@linkcode IDLE_REFRESHES} bulk reads are still dropped). Unset, as in tests, only
   * requests start them.
   */
  signal?: AbortSignal;
  now?: () => number;
}

/** A cache of per-tenant reads (see the module comment). */
export interface TenantCache<V> {
  /**
   * The key's cached read when it is younger than `ttlMs` (its `value` undefined when the key was not found);
   * undefined when there is none, and `get` must read. Answers at once, without a promise.
   */
  peek(key: string): Cached<V> | undefined;
  /** The key's value (undefined when not found), from the cache or a read. @throws what the read throws. */
  get(key: string): Promise<V | undefined>;
  /** Resolves once no read is in flight (a test's queries then end before its database). */
  settled(): Promise<void>;
}

/** Creates a cache of per-tenant reads (see the module comment). */
export function createTenantCache<V>(options: TenantCacheOptions<V>): TenantCache<V> {
  const { read, ttlMs } = options;
  const now = options.now ?? (() => performance.now());
  const merge = options.merge ?? ((_: V, after: V) => after);
  const absentBytes = options.absentBytes ?? ABSENT_CACHE_BYTES;
  const weigh = options.weigh;
  const found = new TenantMap<Entry<V>>(
    options.maxBytes ?? TENANT_CACHE_BYTES,
    weigh && ((entry) => entry.value === undefined ? 0 : weigh(entry.value)),
  );
  const absent = absentBytes > 0 ? new TenantMap<Entry<V>>(absentBytes) : undefined;
  let refreshedAt = now();

  /**
   * Stores what a read sent at `at` found for `key`, unless a later read has stored it already.
   * @returns the key's value now: the one kept from this read, or the later read's.
   */
  const store = (key: string, value: V | undefined, at: number): V | undefined => {
    const before = found.get(key) ?? absent?.get(key);
    if (before && before.readAt > at) return before.value;
    if (value === undefined) {
      found.delete(key);
      absent?.set(key, { value, readAt: at, idle: 0 });
      return undefined;
    }
    absent?.delete(key);
    const kept = before?.value === undefined ? value : merge(before.value, value);
    found.set(key, { value: kept, readAt: at, idle: before?.idle ?? 0 });
    return kept;
  };

  // Two lanes of reads, one read in flight in each: one of the keys requests wait for (`asked`), and one of
  // the keys read again in bulk (`again`, after any asked ones). Keys asked for while a read is in flight go
  // together in the next, and a bulk read never holds up a request's.
  const asked = new Set<string>();
  const again = new Set<string>();
  const waiters = new Map<string, PromiseWithResolvers<V | undefined>>();
  const inFlight = new Map<string, Promise<Map<string, V>>>();
  const reads = { asked: 0, again: 0 };
  let drained: PromiseWithResolvers<void> | undefined;
  const take = (from: Set<string>, keys: string[]) => {
    for (const key of from) {
      if (keys.length === READ_CHUNK) break;
      keys.push(key);
      from.delete(key);
    }
  };
  const send = (lane: keyof typeof reads) => {
    const keys: string[] = [];
    take(asked, keys);
    if (lane === "again") take(again, keys);
    const at = now();
    const reading = read(keys);
    for (const key of keys) inFlight.set(key, reading);
    reads[lane]++;
    /** Ends the read before its callers go on, so that what they do next finds it over. */
    const end = (each: (key: string, waiter: PromiseWithResolvers<V | undefined> | undefined) => void) => {
      reads[lane]--;
      for (const key of keys) {
        if (inFlight.get(key) === reading) inFlight.delete(key);
        const waiter = waiters.get(key);
        waiters.delete(key);
        each(key, waiter);
      }
      pump();
      if (reads.asked + reads.again === 0 && drained) {
        drained.resolve();
        drained = undefined;
      }
    };
    reading.then(
      (values) =>
        end((key, waiter) => {
          // A key read again in bulk but dropped meanwhile (idle, evicted) is not brought back by this read.
          if (waiter) waiter.resolve(store(key, values.get(key), at));
          else if (found.get(key)) store(key, values.get(key), at);
        }),
      // A failed bulk read leaves its entries as they were: each is read alone once it is ttlMs old.
      (error) => end((_, waiter) => waiter?.reject(error)),
    );
  };
  const pump = () => {
    if (reads.asked === 0 && asked.size > 0) send("asked");
    if (reads.again === 0 && again.size > 0) send("again");
  };

  /** Every half TTL while the cache is used: its entries are read again in bulk, those idle too long dropped. */
  const refreshIfDue = (t: number) => {
    if (ttlMs <= 0 || t - refreshedAt < ttlMs / 2 || again.size > 0) return;
    refreshedAt = t;
    for (const key of found.keys()) {
      const entry = found.get(key)!;
      if (++entry.idle > IDLE_REFRESHES) found.delete(key);
      else if (!asked.has(key) && !inFlight.has(key)) again.add(key);
    }
    pump();
  };

  if (options.signal && ttlMs > 0 && !options.signal.aborted) {
    // A quarter of the TTL, so that the half-TTL bulk read is never a whole period late.
    const timer = setInterval(() => refreshIfDue(now()), ttlMs / 4);
    Deno.unrefTimer(timer);
    options.signal.addEventListener("abort", () => clearInterval(timer), { once: true });
  }

  const peek = (key: string): Cached<V> | undefined => {
    const t = now();
    const entry = found.get(key);
    if (entry && t - entry.readAt < ttlMs) {
      entry.idle = 0;
      refreshIfDue(t);
      return entry;
    }
    const miss = absent?.get(key);
    return miss && t - miss.readAt < ttlMs ? miss : undefined;
  };

  return {
    peek,
    get(key) {
      const hit = peek(key);
      if (hit) return Promise.resolve(hit.value);
      const entry = found.get(key);
      if (entry) {
        // Read before and now too old: so, after a pause, are most entries; they are read again together.
        entry.idle = 0;
        refreshIfDue(now());
      }
      const waiter = waiters.get(key);
      if (waiter) return waiter.promise;
      const reading = inFlight.get(key);
      // Its read has stored what it found by the time this runs (its own handler came first).
      if (reading) return reading.then((values) => found.get(key)?.value ?? values.get(key));
      const made = Promise.withResolvers<V | undefined>();
      waiters.set(key, made);
      again.delete(key);
      asked.add(key);
      pump();
      return made.promise;
    },
    settled() {
      if (reads.asked + reads.again === 0) return Promise.resolve();
      drained ??= Promise.withResolvers();
      return drained.promise;
    },
  };
}
