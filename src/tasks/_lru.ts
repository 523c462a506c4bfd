/**
 * A map that keeps at most `capacity` entries, and, given a weigher, at
 * most `maxWeight` of their weights added up (bytes, say), dropping the
 * least recently used entries first. Insertion order of a `Map` is the
 * recency order: a hit moves its key to the end.
 */
export class Lru<K, V> {
  readonly #entries = new Map<K, V>();
  /** The most recently used key: a hit on it needs no move. */
  #last: K | undefined;
  readonly #weigh?: (value: V) => number;
  readonly #weights = new Map<K, number>();
  #weight = 0;
  readonly maxWeight: number;

  constructor(
    readonly capacity: number,
    { maxWeight = Infinity, weigh }: { maxWeight?: number; weigh?: (value: V) => number } = {},
  ) {
    if (!Number.isInteger(capacity) || capacity < 1) {
      throw new RangeError(`An LRU cache holds at least one entry (got capacity ${capacity})`);
    }
    if (!(maxWeight > 0)) throw new RangeError(`An LRU cache's weight bound is above 0 (got ${maxWeight})`);
    this.maxWeight = maxWeight;
    this.#weigh = weigh;
  }

  /** Entries held. */
  get size(): number {
    return this.#entries.size;
  }

  /** Their weights added up (0 without a weigher). */
  get weight(): number {
    return this.#weight;
  }

  /** The value under `key`, now the most recently used; undefined when absent. */
  get(key: K): V | undefined {
    if (key === this.#last) return this.#entries.get(key);
    if (!this.#entries.has(key)) return undefined;
    const value = this.#entries.get(key) as V;
    this.#entries.delete(key);
    this.#entries.set(key, value);
    this.#last = key;
    return value;
  }

  /**
   * Stores `value` as the most recently used, dropping the least recently used entries past `capacity` or
   * `maxWeight`. A value heavier than `maxWeight` alone is not kept (and `key`'s earlier value is gone).
   */
  set(key: K, value: V): void {
    this.delete(key);
    if (this.#weigh) {
      const weight = this.#weigh(value);
      if (weight > this.maxWeight) return;
      this.#weights.set(key, weight);
      this.#weight += weight;
    }
    this.#entries.set(key, value);
    this.#last = key;
    while (this.#entries.size > this.capacity || this.#weight > this.maxWeight) {
      this.delete(this.#entries.keys().next().value as K);
    }
  }

  /** Forgets `key`. */
  delete(key: K): void {
    if (!this.#entries.delete(key)) return;
    if (key === this.#last) this.#last = undefined;
    const weight = this.#weights.get(key);
    if (weight !== undefined) {
      this.#weight -= weight;
      this.#weights.delete(key);
    }
  }

  clear(): void {
    this.#entries.clear();
    this.#weights.clear();
    this.#weight = 0;
    this.#last = undefined;
  }
}
