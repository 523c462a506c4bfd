/**
 * A map of what a process keeps per tenant (or per API key), bounded by an
 * estimate of the bytes it holds rather than by a count of entries, so that
 * it can hold every tenant in use however many there are, within a stated
 * memory bound.
 *
 * Past the bound, the entries stored first go first. They are found with one
 * iterator kept across evictions: a new iterator for each (`keys().next()`)
 * starts at the map's oldest slot and, in V8, steps over every entry deleted
 * before it, which at 10,000 entries was a visible share of intake's CPU. So
 * every operation costs the same at any size.
 */

/**
 * What one entry costs besides its key's characters and its value's own estimate: the map's row, the key's
 * string header, the cache's record of the read. Measured: a cache of 100,000 tenants' flags (`tenant_cache.ts`,
 * names of 10 characters) grew V8's heap by 119 bytes a tenant, which this and the key's characters give.
 */
export const ENTRY_OVERHEAD_BYTES = 112;

/**
 * The estimate of an entry's bytes: the overhead, a byte a character of the key (tenant names and key ids are
 * ASCII, which V8 stores a byte a character), and the value's estimate.
 */
export function entryBytes(key: string, valueBytes = 0): number {
  return ENTRY_OVERHEAD_BYTES + key.length + valueBytes;
}

/** A byte-bounded map that drops its oldest entries past its bound (see the module comment). */
export class TenantMap<V> {
  // The values themselves, with no record around each: a lookup is one step, at any size. An entry's bytes are
  // weighed again when it goes, which is why `weigh` must give the same estimate for a value each time.
  readonly #entries = new Map<string, V>();
  #oldest: Iterator<string> = this.#entries.keys();
  #bytes = 0;
  readonly #weigh: (value: V) => number;

  /**
   * @param maxBytes the most bytes (estimated with {@linkcode entryBytes}) the map holds.
   * @param weigh a value's own estimate in bytes, beyond its key and the overhead: the same each time it is asked
   * about one value. 0 when unset.
   * @throws {RangeError} when `maxBytes` cannot hold one entry.
   */
  constructor(readonly maxBytes: number, weigh?: (value: V) => number) {
    if (!(maxBytes >= ENTRY_OVERHEAD_BYTES)) {
      throw new RangeError(`A tenant map holds at least ${ENTRY_OVERHEAD_BYTES} bytes (got ${maxBytes})`);
    }
    this.#weigh = weigh ?? (() => 0);
  }

  /** Entries held. */
  get size(): number {
    return this.#entries.size;
  }

  /** Their estimated bytes added up: never above `maxBytes`. */
  get bytes(): number {
    return this.#bytes;
  }

  /** The value under `key`; undefined when absent (a value is never undefined). */
  get(key: string): V | undefined {
    return this.#entries.get(key);
  }

  /**
   * Stores `value` under `key`, in its place if the key is held, dropping the oldest entries past the bound. A
   * value heavier than the bound alone is not kept (and the key's earlier value is gone).
   */
  set(key: string, value: V): void {
    const bytes = entryBytes(key, this.#weigh(value));
    const before = this.#entries.get(key);
    if (bytes > this.maxBytes) {
      if (before !== undefined) this.delete(key);
      return;
    }
    this.#bytes += bytes - (before === undefined ? 0 : entryBytes(key, this.#weigh(before)));
    this.#entries.set(key, value);
    while (this.#bytes > this.maxBytes) {
      let next = this.#oldest.next();
      // Only once the map has been emptied does the iterator end: a new one starts at the (new) oldest entry.
      if (next.done) next = (this.#oldest = this.#entries.keys()).next();
      if (next.done) break;
      // The entry just stored may be the oldest left, but then it alone is over the bound, which it is not.
      this.delete(next.value);
    }
  }

  /** Forgets `key`. @returns whether it was held. */
  delete(key: string): boolean {
    const value = this.#entries.get(key);
    if (value === undefined) return false;
    this.#entries.delete(key);
    this.#bytes -= entryBytes(key, this.#weigh(value));
    return true;
  }

  /** The keys held now (a copy: the map may change while a caller works through them). */
  keys(): string[] {
    return [...this.#entries.keys()];
  }
}
