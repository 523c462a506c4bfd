/** Result of {@linkcode closedLoop}. */
export interface LoadResult {
  requests: number;
  errors: number;
  seconds: number;
  perSecond: number;
  latenciesMs: number[];
  statuses: Record<number, number>;
}

/**
 * A closed-loop HTTP load: `connections` loops each send a request, await the
 * answer and send the next, for `seconds`. Bounded in time; loopback only.
 */
export async function closedLoop(
  makeRequest: (i: number) => Request,
  { connections, seconds }: { connections: number; seconds: number },
): Promise<LoadResult> {
  const latenciesMs: number[] = [];
  const statuses: Record<number, number> = {};
  let requests = 0, errors = 0, next = 0;
  const started = performance.now();
  const end = started + seconds * 1000;
  await Promise.all(Array.from({ length: connections }, async () => {
    while (performance.now() < end) {
      const t0 = performance.now();
      try {
        const res = await fetch(makeRequest(next++));
        await res.arrayBuffer();
        statuses[res.status] = (statuses[res.status] ?? 0) + 1;
        if (res.status >= 400) errors++;
      } catch {
        errors++;
      }
      latenciesMs.push(performance.now() - t0);
      requests++;
    }
  }));
  const elapsed = (performance.now() - started) / 1000;
  return { requests, errors, seconds: elapsed, perSecond: requests / elapsed, latenciesMs, statuses };
}
