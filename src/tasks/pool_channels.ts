/**
 * Where a pool's piece of work runs (`worker_pool.ts`): in a child process of
 * this Deno binary, or on a Web Worker in this process. Both speak the same
 * messages (`_pool_worker.ts` serves either).
 *
 * A child process is the default: it is killed at once at its deadline
 * (SIGKILL stops a regular expression or a loop mid-step, where Deno 2.9.6's
 * `Worker.terminate()` does not), its heap is capped (`heapMiB`: past it V8
 * ends the child, not this process), and what it compiled goes back to the
 * system when it ends; a Worker's heap stays in this process's resident
 * memory even after it is terminated. It runs with no permission at all: no
 * file, network, environment or subprocess. It costs this process the right
 * to run its own Deno binary (`--allow-run=<Deno.execPath()>`), and CPU to
 * start (see README, "Defining a task").
 *
 * A binary built by `deno compile` uses Workers (`"thread"`): it cannot run
 * Deno's `run` subcommand, and its path is known only once it is deployed.
 */
import { lineSplitter, POOL_PROCESS_ARG, POOL_STATE, type PoolInit } from "./_pool_worker.ts";

/** Where the work runs; see the module. */
export type PoolIsolation = "process" | "thread";

/** Child processes, unless this is a binary built by `deno compile`. */
export const DEFAULT_ISOLATION: PoolIsolation = Deno.build.standalone ? "thread" : "process";

/** The project's configuration, for the child's imports (`@cfworker/json-schema`, `re2js`). */
const CONFIG = decodeURIComponent(new URL("../../deno.json", import.meta.url).pathname);

/** What a channel tells its pool. */
export interface ChannelEvents {
  /** A message from the other side (`ready`, or a reply). */
  message(data: unknown): void;
  /** It failed on its own (an uncaught error, or a child that exited or was killed by another). */
  failed(message: string): void;
}

/** One Worker or child process, as the pool drives it. */
export interface Channel {
  /** Sends `message`. @throws at once a message that cannot be sent (not cloneable, or not JSON). */
  post(message: unknown): void;
  /**
   * Stops it, `working` or not as far as the pool knows. @returns undefined when nothing it ran can still be
   * running; else whether it still is, asked until it says no (a terminated Worker in the middle of its work goes
   * on until that work ends; a killed process is working until it is reaped).
   */
  stop(working: boolean): (() => boolean) | undefined;
  /** Settles once all it held is released: a child reaped and its pipes read to their end. */
  readonly closed: Promise<void>;
}

/** How to open a channel. */
export interface ChannelOptions {
  isolation: PoolIsolation;
  /** The served module (it calls `serveWorker`). */
  url: string;
  /** The Worker's name. */
  name: string;
  /** A child's V8 heap cap (`--max-old-space-size`), in MiB. */
  heapMiB: number;
  /** The served module's settings (`init`). */
  init: Record<string, unknown>;
}

/** Opens a channel and sends it its settings; it says `ready` once it has them. */
export function openChannel(options: ChannelOptions, on: ChannelEvents): Channel {
  return options.isolation === "process" ? openProcess(options, on) : openWorker(options, on);
}

function openWorker({ url, name, init }: ChannelOptions, on: ChannelEvents): Channel {
  const worker = new Worker(url, { type: "module", name });
  const state = new Int32Array(new SharedArrayBuffer(4));
  worker.onmessage = ({ data }: MessageEvent) => on.message(data);
  worker.onerror = (event) => {
    // Unhandled, a Worker's error would end this process.
    event.preventDefault();
    on.failed(event.message);
  };
  worker.postMessage({ type: "init", state: state.buffer, options: init } satisfies PoolInit);
  return {
    post: (message) => worker.postMessage(message),
    stop() {
      worker.terminate();
      // Work it had not begun, it never begins now; work it had, it finishes (Deno 2.9.6 interrupts no busy thread).
      if (Atomics.compareExchange(state, 0, POOL_STATE.idle, POOL_STATE.cancelled) !== POOL_STATE.busy) return;
      return () => Atomics.load(state, 0) === POOL_STATE.busy;
    },
    closed: Promise.resolve(),
  };
}

/** What a child's standard error is kept of, for the error when it fails. */
const STDERR_TAIL = 2_000;

function openProcess({ url, heapMiB, init }: ChannelOptions, on: ChannelEvents): Channel {
  // Not one of this process's variables is passed on: no secret reaches the child, and no LD_* variable makes
  // Deno refuse the spawn under an --allow-run that names one program. Only where Deno's cache is.
  const env: Record<string, string> = { OTEL_DENO: "false" };
  if (Deno.permissions.querySync({ name: "env", variable: "DENO_DIR" }).state === "granted") {
    const dir = Deno.env.get("DENO_DIR");
    if (dir) env.DENO_DIR = dir;
  }
  const child = new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      "--no-prompt",
      // What this process loaded is in the cache: the child downloads nothing, and writes no lockfile.
      "--cached-only",
      "--no-lock",
      `--config=${CONFIG}`,
      `--v8-flags=--max-old-space-size=${heapMiB}`,
      url,
      POOL_PROCESS_ARG,
    ],
    clearEnv: true,
    env,
    stdin: "piped",
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const writer = child.stdin.getWriter();
  const encoder = new TextEncoder();
  let stopped = false;
  let exited = false;
  let stderr = "";
  const reading = Promise.all([
    // A line cut off by the child's end is no message: its exit says what happened.
    readLines(child.stdout, (line) => {
      if (stopped) return;
      let data: unknown;
      try {
        data = JSON.parse(line);
      } catch {
        data = undefined;
      }
      if (typeof data !== "object" || data === null) {
        // Not the other side's: nothing it says can be trusted now.
        stop();
        return on.failed(`its process wrote what is not a message: ${line.slice(0, 200)}`);
      }
      try {
        on.message(data);
      } catch (error) {
        stop();
        on.failed(`its message could not be taken: ${error instanceof Error ? error.message : String(error)}`);
      }
    }),
    readLines(child.stderr, (line) => void (stderr = `${stderr}${line}\n`.slice(-STDERR_TAIL))),
  ]);
  const status = child.status.then((status) => {
    exited = true;
    return status;
  });
  const closed = Promise.all([status, reading]).then(async ([{ code, signal }]) => {
    await writer.close().catch(() => {});
    if (stopped) return;
    stopped = true;
    const tail = stderr.trim().split("\n").slice(-3).join(" / ");
    on.failed(`its process exited (${signal ?? `code ${code}`})${tail ? `: ${tail}` : ""}`);
  });
  const send = (message: unknown) => {
    // Synchronous, so that a value JSON cannot hold fails the caller at once; the write itself is queued.
    const line = `${JSON.stringify(message)}\n`;
    writer.write(encoder.encode(line)).catch(() => {
      // The child has gone: its exit says why.
    });
  };
  function stop(working = true) {
    if (!stopped) {
      stopped = true;
      try {
        child.kill("SIGKILL");
      } catch {
        // Already gone.
      }
    }
    return exited || !working ? undefined : () => !exited;
  }
  try {
    send({ type: "init", options: init });
  } catch (error) {
    stop();
    throw error;
  }
  return { post: send, stop, closed };
}

/** Reads `stream` as lines of UTF-8 to its end, each whole line to `line` (a last one without newline is dropped). */
async function readLines(stream: ReadableStream<Uint8Array>, line: (text: string) => void): Promise<void> {
  const lines = lineSplitter(line);
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  for (;;) {
    let chunk: ReadableStreamReadResult<string>;
    try {
      chunk = await reader.read();
    } catch {
      // A pipe closed under us: the exit says why.
      return;
    }
    if (chunk.done) return;
    lines.push(chunk.value);
  }
}
