/**
 * A steady, open-loop load of requests in a process of its own, so that neither the process under test nor the
 * bench's own bursts delay its clock: request `i` is sent at `start + i * 1000 / rate` ms whether or not the ones
 * before it have been answered, cycling through the configured requests. Reads its configuration as JSON on stdin
 * ({@linkcode SteadyLoadConfig}), prints `ready`, then one JSON line per answer ({@linkcode SteadySample}), and
 * stops on SIGTERM once the requests in flight are answered (at most 5 s later).
 * Usage: steady_load.ts < CONFIG_JSON
 */

/** One request of the cycle. */
export interface SteadyRequest {
  method: string;
  path: string;
  headers?: Record<string, string>;
  body?: string;
  /** Sent with a fresh `Idempotency-Key` each time. */
  idempotencyKey?: boolean;
  /** Every occurrence of this text in `body` is replaced by the request's sequence number (a new body each time). */
  seq?: string;
  /** The first sequence number (default 0). */
  seqFrom?: number;
}

/** What the load sends. */
export interface SteadyLoadConfig {
  base: string;
  /** Requests per second. */
  rate: number;
  requests: SteadyRequest[];
  /** A field of a JSON answer to print as the sample's `id` (e.g. `run_id`). */
  capture?: string;
}

/** One answer: when its request was sent (epoch ms), how long it took, its status (0: no answer), its tag. */
export interface SteadySample {
  at: number;
  ms: number;
  status: number;
  /** Which request of the cycle (its index). */
  kind: number;
  id?: string;
}

/** Epoch milliseconds with a fraction; the bench marks its phases on the same clock. */
export const epochMs = () => performance.timeOrigin + performance.now();

if (import.meta.main) {
  const config = JSON.parse(await new Response(Deno.stdin.readable).text()) as SteadyLoadConfig;
  const stop = new AbortController();
  Deno.addSignalListener("SIGTERM", () => stop.abort());
  const encoder = new TextEncoder();
  const write = (line: string) => Deno.stdout.writeSync(encoder.encode(line + "\n"));
  const inFlight = new Set<Promise<void>>();
  const send = async (i: number) => {
    const kind = i % config.requests.length;
    const spec = config.requests[kind]!;
    const headers: Record<string, string> = { ...spec.headers };
    if (spec.idempotencyKey) headers["idempotency-key"] = `steady-${crypto.randomUUID()}`;
    const body = spec.body !== undefined && spec.seq
      ? spec.body.replaceAll(spec.seq, String((spec.seqFrom ?? 0) + i))
      : spec.body;
    const at = epochMs();
    let status = 0, id: string | undefined;
    try {
      const res = await fetch(`${config.base}${spec.path}`, {
        method: spec.method,
        headers,
        body,
        signal: AbortSignal.timeout(30_000),
      });
      const text = await res.text();
      status = res.status;
      if (config.capture && res.ok) id = JSON.parse(text)[config.capture];
    } catch { /* no answer: status 0 */ }
    write(JSON.stringify({ at, ms: epochMs() - at, status, kind, ...(id === undefined ? {} : { id }) }));
  };
  write("ready");
  const start = performance.now();
  for (let i = 0; !stop.signal.aborted; i++) {
    const wait = start + (i * 1000) / config.rate - performance.now();
    if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
    if (stop.signal.aborted) break;
    const p = send(i).finally(() => inFlight.delete(p));
    inFlight.add(p);
  }
  await Promise.race([Promise.all(inFlight), new Promise((resolve) => setTimeout(resolve, 5_000))]);
  Deno.exit(0);
}
