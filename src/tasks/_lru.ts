/**
 * A map that keeps at most `capacity` entries, dropping the least recently
 * used one first. Insertion order of a `Map` is the recency order: a hit
 * moves its key to the end.
 */
export class Lru<K, V> {
  readonly #entries = new Map<K, V>();
  /** The most recently used key: a hit on it needs no move. */
  #last: K | undefined;

  constructor(readonly capacity: number) {
    if (!Number.isInteger(capacity) || capacity < 1) {
      throw new RangeError(`An LRU cache holds at least one entry (got capacity ${capacity})`);
    }
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

  /** Stores `value` as the most recently used, dropping the least recently used entry past `capacity`. */
  set(key: K, value: V): void {
    this.#entries.delete(key);
    this.#entries.set(key, value);
    this.#last = key;
    if (this.#entries.size > this.capacity) this.#entries.delete(this.#entries.keys().next().value as K);
  }

  clear(): void {
    this.#entries.clear();
    this.#last = undefined;
  }
}
