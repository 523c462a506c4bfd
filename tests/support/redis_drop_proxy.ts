/**
 * A TCP proxy in front of Redis that loses replies with their connection:
 * with probability `share` per reply, it closes the client's connection
 * after the command went to Redis and Redis answered, without passing the
 * answer on. Redis ran the command; its client never hears of it. Once it
 * has reconnected, ioredis resends the unanswered commands
 * (`autoResendUnfulfilledCommands`), so Redis may run one twice, except
 * those queued in a pipeline (an auto-pipelined batch too) after a reply
 * that did arrive: those it rejects with `AbortError` ("Command aborted due
 * to connection close"), though Redis may have run them. Both are faults a
 * script with an effect must survive (issue 35).
 *
 * It reads just enough RESP (2 and 3) to find where each command and each
 * reply ends. Every command Redis answers exactly once, pipelined or not:
 * `MULTI` and each queued command get their `+OK`/`+QUEUED`, `EXEC` one
 * array, `EVALSHA` one value, so a reply boundary is a top-level value's end
 * and a drop never cuts a reply in two. The replies before the dropped one
 * are passed on; the dropped one and everything after it on that connection
 * are not (the commands after it were forwarded too: Redis may have run
 * them, so they are counted as unanswered).
 *
 * Replies to connection set-up and probes (`AUTH`, `HELLO`, `CLIENT`,
 * `SELECT`, `INFO`, `PING`, `QUIT` by default: `spareCommands`) are never
 * dropped: a process whose start-up `PING` goes unanswered refuses to start
 * by design, a different fault from a write whose outcome is unknown.
 *
 * Connections that leave request/reply (`SUBSCRIBE`, `PSUBSCRIBE`,
 * `SSUBSCRIBE`, `MONITOR`, `HELLO` with RESP3 pushes, `CLIENT REPLY`) are
 * never dropped on from then on, and their bytes pass untouched: a push is
 * not the answer to any command, and losing a subscriber connection loses
 * messages, a different fault from the one this proxy plays.
 *
 * Dependency-free (`Deno.listen`, `Deno.connect`) and repeatable: each
 * connection draws from its own PRNG seeded from `seed` and the
 * connection's number, so the same replies on the same connection meet the
 * same fate whatever the other connections do.
 */
import { seededRandom } from "./random.ts";

/** One client connection, as the `dropOn` filter sees it. */
export interface ProxyConnection {
  /** 1 for the first connection accepted, and so on. */
  readonly id: number;
  /** The name the client gave itself (`CLIENT SETNAME`, which ioredis sends for `connectionName`), if any. */
  readonly name: string | undefined;
  /** Commands forwarded to Redis, and replies passed back. */
  readonly commands: number;
  readonly replies: number;
  /** It left request/reply (pub/sub, MONITOR, RESP3, CLIENT REPLY): never dropped on. */
  readonly spared: boolean;
}

/** Options for {@linkcode startRedisDropProxy}. */
export interface RedisDropProxyOptions {
  /** The Redis to forward to. */
  target: { hostname: string; port: number };
  /** The share of replies dropped with their connection, 0 to 1; default 0. */
  share?: number;
  /** Seed of the PRNG; default 1. */
  seed?: number;
  /** Which connections may lose replies, asked at each reply; default every one. */
  dropOn?: (connection: ProxyConnection) => boolean;
  /** Commands whose replies are never dropped (upper case); default {@linkcode SPARED_COMMANDS}. */
  spareCommands?: readonly string[];
  /** Where to listen; default 127.0.0.1 on a free port. */
  hostname?: string;
  port?: number;
}

/** What the proxy did so far. */
export interface RedisDropProxyStats {
  /** Client connections accepted, and of them those that left request/reply (never dropped on). */
  connections: number;
  spared: number;
  /** Commands forwarded to Redis, and replies passed back to the clients. */
  commands: number;
  replies: number;
  /** Replies dropped, each with its connection. */
  drops: number;
  /** Commands forwarded whose reply never reached the client: each dropped one, and those pipelined after it. */
  unanswered: number;
}

/** A running proxy. */
export interface RedisDropProxy {
  hostname: string;
  port: number;
  /** `redis://host:port/db` of the proxy, for a client. */
  url(db?: number): string;
  readonly stats: Readonly<RedisDropProxyStats>;
  /** Changes the share of replies dropped from now on. */
  setShare(share: number): void;
  /** Stops listening, closes every connection both ways, and waits until each is done. */
  close(): Promise<void>;
}

/** Connection set-up and probes: their replies pass whatever the share. */
export const SPARED_COMMANDS: readonly string[] = ["AUTH", "HELLO", "CLIENT", "SELECT", "INFO", "PING", "QUIT"];

/** The types that open a RESP value; anything else at a command's start is an inline command (one line). */
const SIMPLE = new Set("+-:_,#(".split("").map((c) => c.charCodeAt(0)));
const BULK = new Set("$!=".split("").map((c) => c.charCodeAt(0)));
const ARRAY = new Set("*~>".split("").map((c) => c.charCodeAt(0)));
const MAP = "%".charCodeAt(0), ATTRIBUTE = "|".charCodeAt(0);
const LF = 10, CR = 13;
/** How many arguments of a command, and how many bytes of each, are kept to recognise it. */
const KEPT_ARGS = 3, KEPT_ARG_BYTES = 64;

/**
 * Finds where top-level RESP values end in a byte stream fed in chunks of any size. It keeps no value, only
 * how many values the current top-level one still needs (an aggregate adds its elements; a leaf ends one) and
 * how many payload bytes of a bulk string are left to skip. With `capture`, the first few bulk strings of each
 * top-level value are kept (a command's name and first arguments), and a line that opens no RESP type is an
 * inline command.
 */
class RespScanner {
  #need = 1;
  #skip = 0;
  #bulkLength = 0;
  #inPayload = false;
  #header: number[] = [];
  #inline = false;
  #args: string[] = [];
  #arg: number[] = [];
  readonly #decoder = new TextDecoder();

  constructor(private readonly capture: boolean) {}

  /** Scans `chunk`; calls `onEnd` with the offset just past each top-level value that ends in it, and its args. */
  feed(chunk: Uint8Array, onEnd: (end: number, args: string[]) => void): void {
    for (let i = 0; i < chunk.length;) {
      if (this.#inPayload) {
        const n = Math.min(this.#skip, chunk.length - i);
        if (this.capture && this.#args.length < KEPT_ARGS) {
          // The payload's own bytes (not its CRLF), up to the kept length.
          const at = this.#bulkLength + 2 - this.#skip;
          const upTo = Math.min(n, this.#bulkLength - at, KEPT_ARG_BYTES - this.#arg.length);
          for (let k = 0; k < upTo; k++) this.#arg.push(chunk[i + k]!);
        }
        this.#skip -= n;
        i += n;
        if (this.#skip === 0) {
          this.#inPayload = false;
          if (this.capture && this.#args.length < KEPT_ARGS) {
            this.#args.push(this.#decoder.decode(new Uint8Array(this.#arg)));
          }
          this.#arg = [];
          if (this.#leafDone()) onEnd(i, this.#takeArgs());
        }
        continue;
      }
      // A header line: its type byte and its text up to LF (only the first bytes are kept: a length or count).
      if (this.#header.length === 0 && this.#need === 1) {
        this.#inline = this.capture && !this.#opensValue(chunk[i]!);
      }
      const lf = chunk.indexOf(LF, i);
      const end = lf === -1 ? chunk.length : lf + 1;
      for (let k = i; k < end && this.#header.length < 32; k++) this.#header.push(chunk[k]!);
      i = end;
      if (lf === -1) continue;
      const line = this.#header;
      this.#header = [];
      if (this.#inline) {
        this.#inline = false;
        const text = this.#decoder.decode(new Uint8Array(line)).trim();
        if (text === "") continue; // a bare CRLF between commands is no command
        this.#args = text.split(/\s+/).slice(0, KEPT_ARGS);
        onEnd(i, this.#takeArgs());
        continue;
      }
      if (this.#headerDone(line)) onEnd(i, this.#takeArgs());
    }
  }

  #opensValue(byte: number): boolean {
    return SIMPLE.has(byte) || BULK.has(byte) || ARRAY.has(byte) || byte === MAP || byte === ATTRIBUTE;
  }

  /** A header line read: @returns whether it ended the top-level value. */
  #headerDone(line: number[]): boolean {
    const type = line[0]!;
    let stop = line.length;
    while (stop > 1 && (line[stop - 1] === LF || line[stop - 1] === CR)) stop--;
    const n = Number(this.#decoder.decode(new Uint8Array(line.slice(1, stop))));
    if (BULK.has(type)) {
      if (!(n >= 0)) return this.#leafDone(); // a null bulk string ($-1)
      this.#inPayload = true;
      this.#bulkLength = n;
      this.#skip = n + 2;
      return false;
    }
    if (ARRAY.has(type) || type === MAP) {
      const children = n > 0 ? (type === MAP ? 2 * n : n) : 0;
      if (children === 0) return this.#leafDone(); // empty or null aggregate: complete as it is
      this.#need += children - 1;
      return false;
    }
    if (type === ATTRIBUTE) {
      // Not a value itself: its pairs come, then the value it describes (still counted in need).
      this.#need += 2 * Math.max(0, n);
      return false;
    }
    return this.#leafDone(); // simple string, error, integer, null, double, boolean, big number
  }

  /** @returns whether the value just ended was the last one the top-level value needed. */
  #leafDone(): boolean {
    this.#need--;
    if (this.#need > 0) return false;
    this.#need = 1;
    return true;
  }

  #takeArgs(): string[] {
    const args = this.#args;
    this.#args = [];
    return args;
  }
}

/** Commands after which a connection no longer has one reply per command. */
function leavesRequestReply(args: string[]): boolean {
  const name = (args[0] ?? "").toUpperCase();
  if (["SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE", "MONITOR"].includes(name)) return true;
  if (name === "HELLO") return args[1] === "3";
  return name === "CLIENT" && (args[1] ?? "").toUpperCase() === "REPLY";
}

async function writeAll(conn: Deno.Conn, data: Uint8Array): Promise<void> {
  for (let at = 0; at < data.length;) at += await conn.write(data.subarray(at));
}

/**
 * The PRNG connection `id` draws its drops from: the proxy's seed mixed with the connection's number, so
 * connections draw apart and each one's fate does not hang on the others' traffic.
 */
export function connectionRandom(seed: number, id: number): () => number {
  return seededRandom((Math.imul(seed >>> 0, 0x9e3779b1) ^ Math.imul(id, 0x85ebca6b)) >>> 0);
}

/**
 * Starts the proxy, listening at once; `close()` ends it.
 * @throws {RangeError} when `share` is not within 0 and 1.
 */
export function startRedisDropProxy(options: RedisDropProxyOptions): RedisDropProxy {
  let share = checkShare(options.share ?? 0);
  const seed = options.seed ?? 1;
  const spareCommands = new Set(options.spareCommands ?? SPARED_COMMANDS);
  const hostname = options.hostname ?? "127.0.0.1";
  const listener = Deno.listen({ hostname, port: options.port ?? 0 });
  const port = (listener.addr as Deno.NetAddr).port;
  const stats: RedisDropProxyStats = { connections: 0, spared: 0, commands: 0, replies: 0, drops: 0, unanswered: 0 };
  /** Every connection accepted and not yet over: how to close it, and when it is over. */
  const open = new Set<{ close(): void; done: Promise<void> }>();
  let closing = false;

  function checkShare(value: number): number {
    if (!(value >= 0 && value <= 1)) throw new RangeError(`share must be within 0 and 1 (got ${value})`);
    return value;
  }

  /** Relays one client connection until either side closes it or a reply is dropped. */
  async function serve(client: Deno.TcpConn, id: number, onServer: (server: Deno.TcpConn) => void): Promise<void> {
    let server: Deno.TcpConn;
    try {
      server = await Deno.connect({ hostname: options.target.hostname, port: options.target.port });
    } catch {
      // Redis is down: the client sees its connection closed at once.
      try {
        client.close();
      } catch { /* closed by close() meanwhile */ }
      return;
    }
    onServer(server);
    if (closing) return;
    client.setNoDelay(true);
    server.setNoDelay(true);
    const random = connectionRandom(seed, id);
    const state = { id, name: undefined as string | undefined, commands: 0, replies: 0, spared: false };
    /** The names of the commands forwarded and not yet answered, in order: Redis answers in the same order. */
    const awaiting: string[] = [];

    const upstream = async () => {
      const scanner = new RespScanner(true);
      const buf = new Uint8Array(64 * 1024);
      for (;;) {
        const n = await client.read(buf);
        if (n === null) return;
        const chunk = buf.subarray(0, n);
        scanner.feed(chunk, (_end, args) => {
          state.commands++;
          stats.commands++;
          const name = (args[0] ?? "").toUpperCase();
          awaiting.push(name);
          if (name === "CLIENT" && (args[1] ?? "").toUpperCase() === "SETNAME") state.name = args[2];
          if (!state.spared && leavesRequestReply(args)) {
            state.spared = true;
            stats.spared++;
          }
        });
        // Forwarded before anything of it comes back: a reply dropped is always to a command Redis has.
        await writeAll(server, chunk);
      }
    };

    const downstream = async () => {
      const scanner = new RespScanner(false);
      const buf = new Uint8Array(64 * 1024);
      // Bytes of a reply not yet complete: held back, so that a drop never passes half a reply on.
      let held = new Uint8Array(0);
      for (;;) {
        const n = await server.read(buf);
        if (n === null) return;
        const chunk = buf.subarray(0, n);
        if (state.spared) {
          // Pushes are no replies: passed on as they come (what was held is the start of a reply: it goes first).
          if (held.length > 0) await writeAll(client, held);
          held = new Uint8Array(0);
          await writeAll(client, chunk);
          continue;
        }
        const ends: number[] = [];
        scanner.feed(chunk, (end) => ends.push(end));
        const data = held.length === 0 ? chunk : concat(held, chunk);
        const offset = data.length - chunk.length;
        let kept = 0, dropped = false;
        for (const end of ends) {
          // Only a connection still in request/reply, one the filter names, and a command not spared lose replies.
          const name = awaiting.shift() ?? "";
          const eligible = share > 0 && !state.spared && !spareCommands.has(name) && (options.dropOn?.(state) ?? true);
          if (eligible && random() < share) {
            dropped = true;
            break;
          }
          state.replies++;
          stats.replies++;
          kept = offset + end;
        }
        if (kept > 0) await writeAll(client, data.subarray(0, kept));
        if (dropped) {
          stats.drops++;
          stats.unanswered += state.commands - state.replies;
          return;
        }
        held = data.slice(kept);
      }
    };

    // Whichever side ends first (EOF, an error, a drop) ends both: the other side's read then fails.
    const end = () => closeAll(client, server);
    await Promise.all([upstream().catch(() => {}).finally(end), downstream().catch(() => {}).finally(end)]);
  }

  const accepting = (async () => {
    let id = 0;
    for (;;) {
      let client: Deno.TcpConn;
      try {
        client = await listener.accept();
      } catch {
        return; // the listener was closed
      }
      if (closing) {
        client.close();
        continue;
      }
      stats.connections++;
      let server: Deno.TcpConn | undefined;
      const entry = {
        close: () => closeAll(client, server),
        done: Promise.resolve(),
      };
      entry.done = serve(client, ++id, (s) => {
        server = s;
        if (closing) entry.close();
      }).finally(() => open.delete(entry));
      open.add(entry);
    }
  })();

  return {
    hostname,
    port,
    url: (db = 0) => `redis://${hostname}:${port}/${db}`,
    stats,
    setShare(value) {
      share = checkShare(value);
    },
    async close() {
      closing = true;
      listener.close();
      await accepting;
      const all = [...open];
      for (const entry of all) entry.close();
      await Promise.all(all.map((entry) => entry.done));
    },
  };
}

/** Closes each connection given that is still open. */
function closeAll(...conns: (Deno.Conn | undefined)[]): void {
  for (const conn of conns) {
    try {
      conn?.close();
    } catch { /* already closed */ }
  }
}

function concat(a: Uint8Array, b: Uint8Array): Uint8Array {
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}
