/** Log levels in increasing severity. */
export type LogLevel = "debug" | "info" | "warn" | "error";

const RANK: Record<LogLevel, number> = { debug: 10, info: 20, warn: 30, error: 40 };

/** Fields attached to a log line; keep document text and secrets out. */
export type LogFields = Record<string, unknown>;

/** A structured logger: one JSON object per line. */
export interface Logger {
  debug(event: string, fields?: LogFields): void;
  info(event: string, fields?: LogFields): void;
  warn(event: string, fields?: LogFields): void;
  error(event: string, fields?: LogFields): void;
  /** A logger that adds `fields` to every line. */
  child(fields: LogFields): Logger;
}

/** Options for {@linkcode createLogger}. */
export interface LoggerOptions {
  level?: LogLevel;
  /** Where lines go; defaults to stderr so stdout stays for command output. */
  write?: (line: string) => void;
  now?: () => Date;
}

const encoder = new TextEncoder();

/**
 * How long an `info` or `debug` line may wait in memory before it is written.
 * One write per line cost the API a share of its CPU under load
 * (`op_write_sync` in a `--cpu-prof` under wrk; see README, "Observe"); lines
 * now go out together, at most this late.
 * A `warn` or `error` line is written at once, with every line before it, and
 * so is everything pending when the process exits, or when an uncaught error
 * or rejection is about to end it: only a SIGKILL can lose the last few
 * milliseconds of `info` lines.
 */
export const LOG_FLUSH_MS = 10;
/** The most bytes POSIX writes to a pipe at once, never interleaved with another writer's. */
const PIPE_BUF = 4096;
/** Pending bytes (UTF-16 units) above which the lines are written at once rather than at the next flush. */
const FLUSH_CHARS = 64 * 1024;

let pending: string[] = [];
let pendingChars = 0;
let timer: ReturnType<typeof setTimeout> | undefined;
function flush() {
  if (timer !== undefined) clearTimeout(timer);
  timer = undefined;
  if (pending.length === 0) return;
  const text = pending.join("");
  pending = [];
  pendingChars = 0;
  const bytes = encoder.encode(text);
  // Several processes may share one stderr pipe (`api --parallel`): a write of at most PIPE_BUF bytes is never
  // interleaved with another process's, so the lines go out in writes that size, each ending at a line's end
  // (a longer line alone).
  for (let start = 0; start < bytes.length;) {
    let end = bytes.length;
    if (end - start > PIPE_BUF) {
      const last = bytes.lastIndexOf(0x0a, start + PIPE_BUF - 1);
      end = last >= start ? last + 1 : bytes.indexOf(0x0a, start + PIPE_BUF) + 1 || bytes.length;
    }
    for (let at = start; at < end;) at += Deno.stderr.writeSync(bytes.subarray(at, end));
    start = end;
  }
}
function stderrWriter(line: string, urgent: boolean) {
  pending.push(line + "\n");
  pendingChars += line.length + 1;
  if (urgent || pendingChars >= FLUSH_CHARS) return flush();
  if (timer === undefined) {
    timer = setTimeout(flush, LOG_FLUSH_MS);
    // A pending flush never keeps the process alive: the unload listener below writes what is left.
    Deno.unrefTimer(timer);
  }
}
for (const event of ["unload", "error", "unhandledrejection"]) globalThis.addEventListener(event, flush);

function describe(value: unknown): unknown {
  if (value instanceof Error) {
    const name = value.name === "Error" ? value.constructor.name : value.name;
    const out: Record<string, unknown> = { name, message: value.message };
    if ("status" in value && typeof value.status === "number") out.status = value.status;
    if ("code" in value && value.code !== undefined) out.code = value.code;
    return out;
  }
  return value;
}

/** Keys every line starts with. */
const OWN_KEYS: ReadonlySet<string> = new Set(["ts", "level", "event"]);

/**
 * Creates a JSON-lines logger. Errors are logged by name and message, never by stack. A line is the JSON of
 * `{ts, level, event, ...base, ...fields}`; it is built as a string, the base fields serialised once per logger
 * (the object and its `JSON.stringify` were a third of the logger's time on the API's path).
 */
export function createLogger(options: LoggerOptions = {}, base: LogFields = {}): Logger {
  const min = RANK[options.level ?? "info"];
  const write: (line: string, urgent: boolean) => void = options.write ?? stderrWriter;
  const now = options.now ?? (() => new Date());
  const baseKeys = new Set(Object.keys(base));
  // A base field named like one of a line's own keys would replace it in place: such a logger takes the slow path.
  const plain = !Object.keys(base).some((k) => OWN_KEYS.has(k));
  let baseJson = "";
  for (const [k, v] of Object.entries(base)) {
    const json = JSON.stringify(v);
    if (json !== undefined) baseJson += `,${JSON.stringify(k)}:${json}`;
  }
  /** The line as `JSON.stringify` of the record writes it, or undefined when a field replaces an earlier key. */
  const line = (ts: string, level: LogLevel, event: string, fields?: LogFields): string | undefined => {
    if (!plain) return undefined;
    let out = `{"ts":"${ts}","level":"${level}","event":${JSON.stringify(event)}${baseJson}`;
    if (fields) {
      for (const k of Object.keys(fields)) {
        if (OWN_KEYS.has(k) || baseKeys.has(k)) return undefined;
        const json = JSON.stringify(describe(fields[k]));
        if (json !== undefined) out += `,${JSON.stringify(k)}:${json}`;
      }
    }
    return `${out}}`;
  };
  const emit = (level: LogLevel, event: string, fields?: LogFields) => {
    if (RANK[level] < min) return;
    const ts = now().toISOString();
    let text = line(ts, level, event, fields);
    if (text === undefined) {
      const record: LogFields = { ts, level, event, ...base };
      if (fields) { for (const [k, v] of Object.entries(fields)) record[k] = describe(v); }
      text = JSON.stringify(record);
    }
    write(text, RANK[level] >= RANK.warn);
  };
  return {
    debug: (e, f) => emit("debug", e, f),
    info: (e, f) => emit("info", e, f),
    warn: (e, f) => emit("warn", e, f),
    error: (e, f) => emit("error", e, f),
    child: (fields) => createLogger(options, { ...base, ...fields }),
  };
}

/** A logger that drops everything, for tests that do not inspect logs. */
export const silentLogger: Logger = createLogger({ level: "error", write: () => {} });
