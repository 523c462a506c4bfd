/**
 * Coalesces calls made while a flush is in flight into the next flush: the
 * first call flushes at once (no added latency under light load), and calls
 * that arrive meanwhile share one flush (fewer round trips under heavy load).
 * `flush` returns one result per item, in order.
 */
export function createBatcher<T, R = void>(
  flush: (items: T[]) => Promise<R[]>,
  { maxBatch = 1000, maxInFlight = 1 }: { maxBatch?: number; maxInFlight?: number } = {},
): (item: T) => Promise<R> {
  type Waiter = { item: T; resolve(r: R): void; reject(e: unknown): void };
  let queue: Waiter[] = [];
  let running = 0;
  const pump = () => {
    while (running < maxInFlight && queue.length > 0) {
      const batch = queue.slice(0, maxBatch);
      queue = queue.slice(maxBatch);
      running++;
      flush(batch.map((b) => b.item))
        .then((results) => batch.forEach((b, i) => b.resolve(results[i]!)), (e) => batch.forEach((b) => b.reject(e)))
        .finally(() => {
          running--;
          pump();
        });
    }
  };
  return (item) =>
    new Promise<R>((resolve, reject) => {
      queue.push({ item, resolve, reject });
      pump();
    });
}
