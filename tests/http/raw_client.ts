/**
 * A raw HTTP/1.1 client over TCP, for what `fetch` cannot show: a body sent
 * one byte at a time, a body far larger than the server accepts, and whether
 * the server closed the socket (a read returns null, or the connection is
 * reset) after it answered.
 */

/** One TCP connection to a server, read continuously in the background. */
export interface RawConnection {
  /** Sends bytes; false once the server no longer takes them (closed or reset). */
  write(data: string | Uint8Array): Promise<boolean>;
  /** Sends `data` a byte at a time, one every `everyMs`, until `stop()` or the socket refuses. */
  drip(data: string, everyMs: number): { stop(): void };
  /** Everything received so far. */
  readonly received: string;
  /** The response's status and when (`performance.now()`) its status line arrived; rejects after `timeoutMs`. */
  statusLine(timeoutMs: number): Promise<{ status: number; at: number }>;
  /** When (`performance.now()`) the server closed the socket, or "open" after `timeoutMs`. */
  closed(timeoutMs: number): Promise<number | "open">;
  close(): void;
}

/** Connects to 127.0.0.1:`port`. */
export async function rawConnect(port: number): Promise<RawConnection> {
  const conn = await Deno.connect({ hostname: "127.0.0.1", port });
  const encoder = new TextEncoder();
  const decoder = new TextDecoder();
  let received = "";
  let statusAt: number | undefined;
  let closedAt: number | undefined;
  let closedByUs = false;
  const changed = new Set<() => void>();
  const notify = () => changed.forEach((f) => f());
  (async () => {
    const buf = new Uint8Array(16 * 1024);
    try {
      for (let n = await conn.read(buf); n !== null; n = await conn.read(buf)) {
        received += decoder.decode(buf.subarray(0, n), { stream: true });
        if (statusAt === undefined && /^HTTP\/1\.1 \d{3} /.test(received)) statusAt = performance.now();
        notify();
      }
    } catch {
      /* a reset is a close too */
    }
    closedAt = performance.now();
    notify();
  })();
  /** Resolves with `check()`'s first defined value, or with `fallback()` (which may throw) after `timeoutMs`. */
  const until = <T>(check: () => T | undefined, timeoutMs: number, fallback: () => T): Promise<T> =>
    new Promise((resolve, reject) => {
      const finish = () => {
        clearTimeout(timer);
        changed.delete(poll);
      };
      const poll = () => {
        const value = check();
        if (value === undefined) return;
        finish();
        resolve(value);
      };
      const timer = setTimeout(() => {
        finish();
        try {
          resolve(fallback());
        } catch (error) {
          reject(error);
        }
      }, timeoutMs);
      changed.add(poll);
      poll();
    });
  let writing = Promise.resolve(true);
  const write = (data: string | Uint8Array) =>
    writing = writing.then(async (ok) => {
      if (!ok || closedAt !== undefined || closedByUs) return false;
      try {
        const bytes = typeof data === "string" ? encoder.encode(data) : data;
        for (let off = 0; off < bytes.length;) off += await conn.write(bytes.subarray(off));
        return true;
      } catch {
        return false;
      }
    });
  return {
    write,
    drip(data, everyMs) {
      let i = 0;
      const timer = setInterval(async () => {
        if (i >= data.length || !(await write(data[i++]!))) clearInterval(timer);
      }, everyMs);
      return { stop: () => clearInterval(timer) };
    },
    get received() {
      return received;
    },
    statusLine(timeoutMs) {
      return until(
        () => statusAt === undefined ? undefined : { status: Number(received.slice(9, 12)), at: statusAt },
        timeoutMs,
        () => {
          throw new Error(`no response within ${timeoutMs} ms (received ${JSON.stringify(received.slice(0, 200))})`);
        },
      );
    },
    closed(timeoutMs) {
      return until<number | "open">(() => closedAt, timeoutMs, () => "open");
    },
    close() {
      if (closedByUs) return;
      closedByUs = true;
      try {
        conn.close();
      } catch { /* already closed */ }
    },
  };
}
