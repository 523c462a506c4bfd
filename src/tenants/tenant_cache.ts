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
 * - With a change log (`changes`, `tenant_changes.ts`), the half-TTL pass
 *   reads no entry at all unless its tenant changed: one query asks which
 *   tenants changed since the snapshot of the last pass, their entries are
 *   dropped (read at their next use), and every other entry is confirmed as
 *   of the new snapshot. Only entries the log cannot vouch for (read before
 *   the last pass, answered after it) are read again in bulk. At 20,000
 *   tenants the bulk re-reads were some 5% of the API's CPU under load.
 *
 * What it promises is unchanged by that: every value it answers with comes
 * from a read, or a look at the change log that found its tenant unchanged
 * since that read, sent less than `ttlMs` before, so a change in Postgres (a
 * revoked key, a changed list) takes effect within `ttlMs`. A key the read did
 * not find (an unknown id, a tenant with no active key) is cached apart, in
 * its own bound ({@linkcode ABSENT_CACHE_BYTES}), and never read in bulk: a
 * flood of invented keys costs at most a query per key per `ttlMs`, fills only
 * that part, and never evicts a key in use.
 */
import { TenantMap } from "./tenant_map.ts";
import { CHANGES_KEPT_MS, type Snapshot, type TenantChangeFeed, type TenantChanges } from "./tenant_changes.ts";

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

/** A look at the change log: its snapshot and when it was sent (the cache's clock). */
interface Look {
  readonly snapshot: Snapshot;
  readonly sentAt: number;
}

interface Entry<V> extends Cached<V> {
  value: V | undefined;
  /** When the read that found it, or the look that confirmed it, was sent (the cache's clock). */
  readAt: number;
  /** Bulk reads since its last use. */
  idle: number;
  /**
   * The last look at the change log answered before its read was sent (or that confirmed it): the entry holds
   * every change that look saw. Unset without a log, or before the first look.
   */
  base?: Look;
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
  /**
   * The tenant change log (`tenant_changes.ts`): with it, the half-TTL pass asks which tenants changed instead of
   * reading every entry again. Unset, every entry is read again in bulk.
   */
  changes?: TenantChangeFeed;
  /** The tenant a found entry belongs to, for the change log: the key itself when unset. */
  tenantOf?: (key: string, value: V) => string;
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

/** A cache's entries, found and found absent, and how a value read again is kept. */
interface Entries<V> {
  found: TenantMap<Entry<V>>;
  absent: TenantMap<Entry<V>> | undefined;
  merge: (before: V, after: V) => V;
}

/**
 * Stores what a read sent at `at` (after the look `base` was answered) found for `key`, unless a later read has
 * stored it already. @returns the key's value now: the one kept from this read, or the later read's.
 */
function storeRead<V>(
  { found, absent, merge }: Entries<V>,
  key: string,
  value: V | undefined,
  at: number,
  base: Look | undefined,
): V | undefined {
  const before = found.get(key) ?? absent?.get(key);
  if (before && before.readAt > at) return before.value;
  if (value === undefined) {
    found.delete(key);
    absent?.set(key, { value, readAt: at, idle: 0 });
    return undefined;
  }
  absent?.delete(key);
  const kept = before?.value === undefined ? value : merge(before.value, value);
  found.set(key, { value: kept, readAt: at, idle: before?.idle ?? 0, base });
  return kept;
}

/**
 * Applies a look at the change log (sent at `sentAt`, asking what `since` could not see) to the entries: those
 * based on `since` whose tenant did not change are confirmed as of the new look, those whose tenant changed are
 * dropped (read afresh at their next use), and those the log cannot vouch for (read before `since` was answered,
 * or every one when there is no `since` or any tenant may have changed) are read again in bulk. Entries idle too
 * long are dropped.
 * @returns the new look.
 */
function confirmThroughLook<V>(
  found: TenantMap<Entry<V>>,
  { since, seen, sentAt }: { since: Look | undefined; seen: TenantChanges; sentAt: number },
  tenantOf: (key: string, value: V) => string,
  lanes: ReadLanes<V>,
): Look {
  const next: Look = { snapshot: seen.snapshot, sentAt };
  const changed = since === undefined ? null : seen.tenants;
  for (const key of found.keys()) {
    const entry = found.get(key)!;
    if (++entry.idle > IDLE_REFRESHES) found.delete(key);
    else if (changed === null || entry.base !== since) lanes.readAgain(key);
    else if (changed.has(tenantOf(key, entry.value!))) {
      found.delete(key);
      lanes.forget(key);
    } else {
      entry.base = next;
      if (entry.readAt < sentAt) entry.readAt = sentAt;
    }
  }
  return next;
}

/**
 * Two lanes of reads, one read in flight in each: one of the keys requests wait for (`asked`), and one of the
 * keys read again in bulk (`again`, after any asked ones). Keys asked for while a read is in flight go together
 * in the next, and a bulk read never holds up a request's.
 */
class ReadLanes<V> {
  readonly #asked = new Set<string>();
  readonly #again = new Set<string>();
  readonly #waiters = new Map<string, PromiseWithResolvers<V | undefined>>();
  readonly #inFlight = new Map<string, Promise<Map<string, V>>>();
  readonly #reads = { asked: 0, again: 0 };
  #drained: PromiseWithResolvers<void> | undefined;

  /**
   * @param read the cache's read of keys.
   * @param idle whether the cache has nothing else in flight (a look at the change log), for `settled`.
   * @param sending called as a read is sent: returns what stores each key's value the read finds (`asked`: a
   * request waits for it) and returns the value to answer with.
   */
  constructor(
    private readonly read: (keys: string[]) => Promise<Map<string, V>>,
    private readonly idle: () => boolean,
    private readonly sending: () => (key: string, value: V | undefined, asked: boolean) => V | undefined,
  ) {}

  /** Whether keys wait for a bulk read. */
  get bulkWaiting(): boolean {
    return this.#again.size > 0;
  }

  /** Reads a key again in bulk, unless a read of it is due or in flight. */
  readAgain(key: string): void {
    if (!this.#asked.has(key) && !this.#inFlight.has(key)) this.#again.add(key);
  }

  /**
   * Lets the next request for the key send a read of its own rather than join the one in flight, whose answer may
   * predate a change the log has just reported. Whoever waits for that read still gets its answer.
   */
  forget(key: string): void {
    this.#inFlight.delete(key);
    this.#waiters.delete(key);
  }

  /** The key's value from the read in flight or a read of its own; `fromInFlight` picks it out of a read's map. */
  ask(key: string, fromInFlight: (values: Map<string, V>) => V | undefined): Promise<V | undefined> {
    const waiter = this.#waiters.get(key);
    if (waiter) return waiter.promise;
    const reading = this.#inFlight.get(key);
    if (reading) return reading.then(fromInFlight);
    const made = Promise.withResolvers<V | undefined>();
    this.#waiters.set(key, made);
    this.#again.delete(key);
    this.#asked.add(key);
    this.pump();
    return made.promise;
  }

  /** Sends what waits in each lane with no read in flight; resolves `settled` once nothing is in flight. */
  pump(): void {
    if (this.#reads.asked === 0 && this.#asked.size > 0) this.#send("asked");
    if (this.#reads.again === 0 && this.#again.size > 0) this.#send("again");
    if (this.#reads.asked + this.#reads.again === 0 && this.idle() && this.#drained) {
      this.#drained.resolve();
      this.#drained = undefined;
    }
  }

  /** Resolves once no read is in flight and the cache is idle. */
  settled(): Promise<void> {
    if (this.#reads.asked + this.#reads.again === 0 && this.idle()) return Promise.resolve();
    this.#drained ??= Promise.withResolvers();
    return this.#drained.promise;
  }

  #take(from: Set<string>, keys: string[]) {
    for (const key of from) {
      if (keys.length === READ_CHUNK) break;
      keys.push(key);
      from.delete(key);
    }
  }

  #send(lane: "asked" | "again") {
    const keys: string[] = [];
    this.#take(this.#asked, keys);
    if (lane === "again") this.#take(this.#again, keys);
    const keep = this.sending();
    const reading = this.read(keys);
    // Its waiters are taken now: a key forgotten meanwhile gets a waiter of its own, for a read of its own.
    const waiters = keys.map((key) => this.#waiters.get(key));
    for (const key of keys) this.#inFlight.set(key, reading);
    this.#reads[lane]++;
    /** Ends the read before its callers go on, so that what they do next finds it over. */
    const end = (each: (key: string, waiter: PromiseWithResolvers<V | undefined> | undefined) => void) => {
      this.#reads[lane]--;
      for (const [i, key] of keys.entries()) {
        if (this.#inFlight.get(key) === reading) this.#inFlight.delete(key);
        const waiter = waiters[i];
        if (waiter && this.#waiters.get(key) === waiter) this.#waiters.delete(key);
        each(key, waiter);
      }
      this.pump();
    };
    reading.then(
      (values) =>
        end((key, waiter) => {
          const value = keep(key, values.get(key), waiter !== undefined);
          waiter?.resolve(value);
        }),
      // A failed bulk read leaves its entries as they were: each is read alone once it is ttlMs old.
      (error) => end((_, waiter) => waiter?.reject(error)),
    );
  }
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
  const changes = options.changes;
  const tenantOf = options.tenantOf ?? ((key: string) => key);
  let refreshedAt = now();
  /** The last look at the change log answered, and whether one is in flight. */
  let look: Look | undefined;
  let looking = false;

  const store = (key: string, value: V | undefined, at: number, base: Look | undefined) =>
    storeRead({ found, absent, merge }, key, value, at, base);

  const lanes = new ReadLanes<V>(read, () => !looking, () => {
    const at = now();
    const base = look;
    // A key read again in bulk but dropped meanwhile (idle, evicted) is not brought back by this read.
    return (key, value, asked) => asked || found.get(key) ? store(key, value, at, base) : undefined;
  });

  /** Reads every entry again in bulk, dropping those idle across too many passes. */
  const readAllAgain = () => {
    for (const key of found.keys()) {
      const entry = found.get(key)!;
      if (++entry.idle > IDLE_REFRESHES) found.delete(key);
      else lanes.readAgain(key);
    }
    lanes.pump();
  };

  /** Looks at the change log at `t`, asking what `since` could not see (`confirmThroughLook`). */
  const lookAtChanges = (feed: TenantChangeFeed, t: number, since: Look | undefined) => {
    looking = true;
    feed(since?.snapshot).then(
      (seen) => {
        looking = false;
        look = confirmThroughLook(found, { since, seen, sentAt: t }, tenantOf, lanes);
        lanes.pump();
      },
      // No look (the log's table missing before `deno task migrate`, Postgres down): the entries are read again in
      // bulk, as without a log, so they stay fresh; the next pass looks again, from the same snapshot.
      () => {
        looking = false;
        readAllAgain();
      },
    );
  };

  /**
   * Every half TTL while the cache is used: the entries are confirmed through the change log, or read again in
   * bulk, and those idle too long dropped.
   */
  const refreshIfDue = (t: number) => {
    if (ttlMs <= 0 || t - refreshedAt < ttlMs / 2 || lanes.bulkWaiting || looking) return;
    refreshedAt = t;
    if (changes) {
      // The log keeps its rows for a while only: after a longer gap, a look starts afresh and vouches for nothing.
      lookAtChanges(changes, t, look && t - look.sentAt < CHANGES_KEPT_MS / 2 ? look : undefined);
      return;
    }
    readAllAgain();
  };
  // The first look, so that the first reads have a snapshot to be confirmed against.
  if (changes && ttlMs > 0) lookAtChanges(changes, now(), undefined);

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
      // A read in flight has stored what it found by the time this runs (its own handler came first).
      return lanes.ask(key, (values) => found.get(key)?.value ?? values.get(key));
    },
    settled: () => lanes.settled(),
  };
}
