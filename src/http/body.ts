import { createDeadlineQueue, type Deadline, type DeadlineQueue } from "../async/deadline_queue.ts";
import { HttpError } from "./problem.ts";

/** How long a request body may take to arrive, however it is sent. */
export const BODY_DEADLINE_MS = 10_000;

/**
 * How long after a refusal (413, 408, 415) the unread rest of a body is let go.
 *
 * Deno.serve (2.9, its own HTTP/1.1 path) never closes a connection while it
 * still expects body bytes: if the handler lets go of the body before the
 * response is written, the server reads the rest of it to the end before it
 * closes (a 200 MiB upload, or a drip that never ends, kept the socket open
 * however the 408 said `Connection: close`). If a reader still holds the body
 * when the response goes out, the server hands the connection to that reader
 * and closes the socket as soon as the reader lets go. So a refused body MUST
 * be held until its response has been written, and only then cancelled: the
 * response is written as soon as the handler returns, 100 ms leaves ample
 * margin, and letting go too early only falls back to draining. A read that
 * is still waiting for bytes cannot be interrupted: the socket then closes
 * when the next byte arrives (or when the client gives up).
 */
const RELEASE_AFTER_MS = 100;

/** Limits on reading one request body. */
export interface BodyLimits {
  /** The most bytes accepted (`MAX_BODY_BYTES`); a longer body is refused with 413 without being read whole. */
  maxBytes: number;
  /** How long the whole body may take to arrive; default {@linkcode BODY_DEADLINE_MS}. */
  deadlineMs?: number;
}

/** The bodies' deadlines, one queue (and one timer) per deadline length. */
const deadlineQueues = new Map<number, DeadlineQueue>();
function deadlineQueue(ms: number): DeadlineQueue {
  let queue = deadlineQueues.get(ms);
  if (!queue) deadlineQueues.set(ms, queue = createDeadlineQueue(ms));
  return queue;
}

/** UTF-8 that refuses malformed bytes; without `stream`, each `decode` stands alone. */
const utf8 = new TextDecoder("utf-8", { fatal: true });

const tooLarge = (maxBytes: number) => new HttpError(413, `Request body exceeds ${maxBytes} bytes`);

/** Cancels `reader` once the refusal's response has been written, so Deno.serve closes the socket instead of draining. */
function releaseAfterResponse(reader: ReadableStreamDefaultReader<Uint8Array>): void {
  setTimeout(() => reader.cancel().catch(() => {}), RELEASE_AFTER_MS);
}

/**
 * Leaves a body unread (a refused content type) so that the connection
 * closes after the response, rather than being read to its end.
 */
function refuseBody(req: Request): void {
  if (req.body && !req.body.locked) releaseAfterResponse(req.body.getReader());
}

/**
 * After any response to a request whose body was never read (refused before
 * reading: 401, 405, a bad header): lets the body go, so the connection
 * closes instead of being drained for as long as the client drips it.
 */
export function releaseUnreadBody(req: Request): void {
  if (!req.bodyUsed) refuseBody(req);
}

/**
 * The one reader of request bodies: reads the whole body of `req`, at most
 * `maxBytes`, within `deadlineMs`. A declared length over the limit is
 * refused before reading; an undeclared one is refused as soon as it passes
 * the limit, so a large body is never held in memory whole. After a refusal
 * the connection is closed, not drained (see `RELEASE_AFTER_MS`).
 * @throws {HttpError} 413 if too large; 408 (with `Connection: close`) if the body has not arrived within
 * `deadlineMs`; 400 if the client broke off.
 */
export async function readBody(
  req: Request,
  { maxBytes, deadlineMs = BODY_DEADLINE_MS }: BodyLimits,
): Promise<Uint8Array> {
  if (req.body === null) return new Uint8Array();
  // One reader for every body, declared length or not: `req.arrayBuffer()` cannot be stopped once started, so a
  // body dripped within its declared length would hold the connection for as long as the client likes. The price
  // is some throughput on small and large bodies (measured in the README, "Security", "Oversized bodies").
  const reader = req.body.getReader();
  const declared = req.headers.get("content-length");
  if (declared !== null && Number(declared) > maxBytes) {
    releaseAfterResponse(reader);
    throw tooLarge(maxBytes);
  }
  const chunks: Uint8Array[] = [];
  let size = 0;
  // A client that sends its body a byte at a time must not hold the request (and its connection) open.
  const queue = deadlineQueue(deadlineMs);
  let deadline!: Deadline;
  const late = new Promise<undefined>((resolve) => deadline = queue.set(resolve as () => void));
  try {
    for (;;) {
      let next: ReadableStreamReadResult<Uint8Array> | undefined;
      try {
        // When the deadline wins, the read may still fail later: the race has already handled it.
        next = await Promise.race([reader.read(), late]);
      } catch (cause) {
        throw new HttpError(400, "The request body could not be read to its end", {}, { cause });
      }
      if (next === undefined) {
        releaseAfterResponse(reader);
        // No Connection header of ours: Deno sends `connection: close` itself when it closes the socket (as it
        // does here, the body released), and a second copy made two on the wire.
        throw new HttpError(408, `The request body did not arrive within ${deadlineMs / 1000} s`);
      }
      if (next.done) break;
      size += next.value.byteLength;
      if (size > maxBytes) {
        releaseAfterResponse(reader);
        throw tooLarge(maxBytes);
      }
      chunks.push(next.value);
    }
  } finally {
    queue.clear(deadline);
  }
  if (chunks.length === 1) return chunks[0]!;
  const bytes = new Uint8Array(size);
  let offset = 0;
  for (const chunk of chunks) {
    bytes.set(chunk, offset);
    offset += chunk.byteLength;
  }
  return bytes;
}

/** The media type of `req`, lower case, without parameters ("" when absent). */
function mediaType(req: Request): string {
  const header = req.headers.get("content-type");
  if (header === null) return "";
  return header === "application/json" ? header : header.split(";")[0]!.trim().toLowerCase();
}

/**
 * Reads a JSON request body through {@linkcode readBody}.
 * @throws {HttpError} 415 if not JSON, 413 if too large, 400 if malformed or with a key twice in one object,
 * 408 (with `Connection: close`) if the body has not arrived within `deadlineMs`.
 */
export async function readJsonBody(
  req: Request,
  maxBytes: number,
  { deadlineMs = BODY_DEADLINE_MS }: { deadlineMs?: number } = {},
): Promise<unknown> {
  const type = mediaType(req);
  if (type !== "application/json" && !/^application\/[a-z0-9.+-]*\+json$/.test(type)) {
    refuseBody(req);
    throw new HttpError(415, `Content-Type must be application/json (got ${JSON.stringify(type || "none")})`);
  }
  const bytes = await readBody(req, { maxBytes, deadlineMs });
  if (bytes.length === 0) throw new HttpError(400, "Request body is empty; expected a JSON object");
  let text: string;
  try {
    text = utf8.decode(bytes);
  } catch (cause) {
    throw new HttpError(400, "Request body is not valid UTF-8", {}, { cause });
  }
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (cause) {
    throw new HttpError(400, "Request body is not valid JSON", {}, { cause });
  }
  // JSON.parse keeps the last of two equal keys; a client that sent both meant something we cannot know.
  const duplicate = duplicateKey(text);
  if (duplicate !== null) {
    // Bounded: the key is the client's, and may be most of the body.
    const shown = duplicate.length > 64 ? `${duplicate.slice(0, 64)}...` : duplicate;
    throw new HttpError(400, `Request body has the key ${JSON.stringify(shown)} twice`);
  }
  return value;
}

/**
 * Reads an `application/x-www-form-urlencoded` body (an HTML form's POST)
 * through {@linkcode readBody}.
 * @throws {HttpError} 415 if not a form, 413 if too large, 408 (with `Connection: close`) if late.
 */
export async function readFormBody(req: Request, limits: BodyLimits): Promise<URLSearchParams> {
  const type = mediaType(req);
  if (type !== "application/x-www-form-urlencoded") {
    refuseBody(req);
    throw new HttpError(
      415,
      `Content-Type must be application/x-www-form-urlencoded (got ${JSON.stringify(type || "none")})`,
    );
  }
  return new URLSearchParams(new TextDecoder().decode(await readBody(req, limits)));
}

/**
 * The first key that appears twice in one object of a JSON text (already
 * known to be valid), compared after unescaping, or null. Strings are
 * skipped with indexOf, so a large document costs little.
 */
export function duplicateKey(text: string): string | null {
  const objects: (Set<string> | null)[] = []; // null: an array level
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (c === 0x22 /* " */) {
      let end = i + 1;
      for (;;) {
        end = text.indexOf('"', end);
        let slashes = 0;
        while (text.charCodeAt(end - 1 - slashes) === 0x5c) slashes++;
        if (slashes % 2 === 0) break;
        end++;
      }
      const top = objects[objects.length - 1];
      if (top) {
        let j = end + 1;
        // JSON's whitespace: space, tab, line feed, carriage return.
        for (
          let w = text.charCodeAt(j);
          w === 0x20 || w === 0x09 || w === 0x0a || w === 0x0d;
          w = text.charCodeAt(++j)
        );
        if (text.charCodeAt(j) === 0x3a /* : */) {
          // Unescaped only when it has an escape: most keys are plain.
          const raw = text.slice(i + 1, end);
          const key = raw.includes("\\") ? JSON.parse(`"${raw}"`) as string : raw;
          if (top.has(key)) return key;
          top.add(key);
        }
      }
      i = end;
    } else if (c === 0x7b /* { */) objects.push(new Set());
    else if (c === 0x5b /* [ */) objects.push(null);
    else if (c === 0x7d /* } */ || c === 0x5d /* ] */) objects.pop();
  }
  return null;
}
