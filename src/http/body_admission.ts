/**
 * How many bytes of request bodies each tenant may have in flight in this
 * process. A tenant that sends hundreds of large POSTs at once would have
 * this process read, parse and check every one of them before intake or
 * validation refused most (a flood of 200 bodies of 100 KB is 20 MB of JSON
 * on the thread that serves every tenant); past its share, a POST is refused
 * before its body is read, and the connection is let go unread.
 *
 * A body counts by its declared length (`Content-Length`), or the largest a
 * body may be when it declares none, from before it is read until its run is
 * handed to intake (not while the request then waits for the run: that costs
 * this process nothing). A body larger than the share alone is admitted when
 * the tenant has nothing else in flight, so any body the API accepts can be
 * sent one at a time.
 */

/** One tenant's admitted body: give it back once; a second call does nothing. */
export type BodyRelease = () => void;

/** The per-tenant shares of one process. */
export interface BodyAdmission {
  /** Admits `bytes` of `tenant`'s, or undefined when the tenant's share is full. */
  admit(tenant: string, bytes: number): BodyRelease | undefined;
  /** Bytes in flight for `tenant` (0 when none). */
  inFlight(tenant: string): number;
}

/** Shares of `maxBytes` a tenant; 0: no bound. */
export function createBodyAdmission(maxBytes: number): BodyAdmission {
  const held = new Map<string, number>();
  return {
    admit(tenant, bytes) {
      const now = held.get(tenant) ?? 0;
      if (maxBytes > 0 && now > 0 && now + bytes > maxBytes) return undefined;
      held.set(tenant, now + bytes);
      let released = false;
      return () => {
        if (released) return;
        released = true;
        const left = (held.get(tenant) ?? bytes) - bytes;
        if (left <= 0) held.delete(tenant);
        else held.set(tenant, left);
      };
    },
    inFlight: (tenant) => held.get(tenant) ?? 0,
  };
}

/** What a body of `req` counts: its declared length, else `maxBodyBytes`. */
export function declaredBytes(req: Request, maxBodyBytes: number): number {
  const header = req.headers.get("content-length");
  const length = header === null ? NaN : Number(header);
  return Number.isSafeInteger(length) && length >= 0 ? Math.min(length, maxBodyBytes) : maxBodyBytes;
}
