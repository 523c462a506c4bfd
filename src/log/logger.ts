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

/** How long a line may wait to share its write with later ones, and how much may wait. */
const STDERR_BATCH = { ms: 5, bytes: 64 * 1024 } as const;

// Lines logged within a few milliseconds go out in one write: under load (a worker logs a line per job) that is
// one syscall, and one wake-up of whatever reads the pipe, per batch instead of per line. Whatever is left is
// written when the process exits.
let pending: string[] = [];
let pendingBytes = 0;
let timer: ReturnType<typeof setTimeout> | undefined;
function flush() {
  if (timer !== undefined) clearTimeout(timer);
  timer = undefined;
  const text = pending.join("");
  pending = [];
  pendingBytes = 0;
  const bytes = encoder.encode(text);
  for (let written = 0; written < bytes.length;) written += Deno.stderr.writeSync(bytes.subarray(written));
}
function stderrWriter(line: string) {
  pending.push(line + "\n");
  pendingBytes += line.length + 1;
  if (pendingBytes >= STDERR_BATCH.bytes) flush();
  else if (timer === undefined) {
    timer = setTimeout(flush, STDERR_BATCH.ms);
    Deno.unrefTimer(timer);
  }
}
globalThis.addEventListener("unload", () => pending.length && flush());

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

/** Creates a JSON-lines logger. Errors are logged by name and message, never by stack. */
export function createLogger(options: LoggerOptions = {}, base: LogFields = {}): Logger {
  const min = RANK[options.level ?? "info"];
  const write = options.write ?? stderrWriter;
  const now = options.now ?? (() => new Date());
  const emit = (level: LogLevel, event: string, fields?: LogFields) => {
    if (RANK[level] < min) return;
    const record: LogFields = { ts: now().toISOString(), level, event, ...base };
    if (fields) { for (const [k, v] of Object.entries(fields)) record[k] = describe(v); }
    write(JSON.stringify(record));
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
