/**
 * `deno task api --parallel[=N]`: one API deployment on every core. The
 * launcher starts N API processes, each `main.ts api --reuse-port` with the
 * same locked permission set, all listening on HOST:PORT with SO_REUSEPORT,
 * so the kernel spreads connections across them (Linux only). It supervises
 * them:
 *
 * - SIGTERM or SIGINT goes to every process; each stops as a single API
 *   does (stops accepting, finishes in flight, exits 0 within 10 s), and the
 *   launcher exits 0 once all have, or with the first failing code.
 * - A process that exits on its own, or dies, is not restarted: the others
 *   are stopped the same graceful way and the launcher exits non-zero (the
 *   process's code, or 1). A crash loop then shows where the deployment is
 *   supervised (systemd, compose's `restart:`, Kubernetes), with its backoff
 *   and its record, rather than being hidden here, and a deployment never
 *   runs on fewer processes than it was started with.
 * - Should a process outlive its grace period, it is killed and the
 *   launcher exits non-zero.
 *
 * Loaded by the launcher, so it imports nothing of the service.
 */

/** How long after the stop a process that has not exited is killed (the contract's 10 s, less a margin). */
export const PARALLEL_KILL_AFTER_MS = 9_500;

/** The most processes `--parallel=N` starts. */
export const MAX_PARALLEL = 64;

/** The argument the launcher gives each API process so that it shares its port (`reusePort`). */
export const REUSE_PORT_ARG = "--reuse-port";

/** `--parallel` or `--parallel=N` among a command's arguments, and the arguments without it. */
export interface ParallelArgs {
  /** How many API processes to start; undefined without `--parallel`. */
  processes?: number;
  rest: string[];
}

/**
 * Reads `--parallel` (one process per core: `cores`) or `--parallel=N` (1 to {@linkcode MAX_PARALLEL}).
 * @throws {TypeError} naming the value, for an N that is not a whole number in that range.
 */
export function parallelArgs(args: readonly string[], cores: number): ParallelArgs {
  let processes: number | undefined;
  const rest: string[] = [];
  for (const arg of args) {
    if (arg === "--parallel") processes = Math.max(1, Math.min(MAX_PARALLEL, cores));
    else if (arg.startsWith("--parallel=")) {
      const value = arg.slice("--parallel=".length);
      const n = /^\d{1,3}$/.test(value) ? Number(value) : NaN;
      if (!(n >= 1 && n <= MAX_PARALLEL)) {
        throw new TypeError(`--parallel must be a number of processes from 1 to ${MAX_PARALLEL} (got "${value}")`);
      }
      processes = n;
    } else rest.push(arg);
  }
  return { processes, rest };
}

/** What the supervisor reports, as the launcher's log lines. */
export interface ParallelEvents {
  started(pids: number[]): void;
  /** A process exited while the others were serving: the deployment stops. */
  lost(pid: number, status: Deno.CommandStatus): void;
  /** Killed after its grace period. */
  killed(pid: number): void;
}

/**
 * Starts `count` processes with `spawn(i)` and supervises them until they have all exited (see the module
 * comment). SIGTERM and SIGINT are forwarded to every process, as is a stop of the launcher's own parent
 * (`watchParent`). @returns the launcher's exit code.
 */
export async function superviseParallel(
  spawn: (index: number) => Deno.ChildProcess,
  count: number,
  { events, watchParent, killAfterMs = PARALLEL_KILL_AFTER_MS }: {
    events: ParallelEvents;
    /** Calls back once the process that started the launcher is gone. */
    watchParent?: (onOrphaned: () => void) => void;
    killAfterMs?: number;
  },
): Promise<number> {
  const children: Deno.ChildProcess[] = [];
  let stopping = false;
  let code = 0;
  let killTimer: ReturnType<typeof setTimeout> | undefined;
  const signal = (child: Deno.ChildProcess, name: Deno.Signal) => {
    try {
      child.kill(name);
    } catch { /* already gone */ }
  };
  const stop = (name: Deno.Signal) => {
    for (const child of children) signal(child, name);
    if (stopping) return;
    stopping = true;
    killTimer = setTimeout(() => {
      for (const child of children) {
        signal(child, "SIGKILL");
        events.killed(child.pid);
      }
      code ||= 1;
    }, killAfterMs);
  };
  const handlers = (["SIGTERM", "SIGINT"] as const).map((name) => {
    const handler = () => stop(name);
    Deno.addSignalListener(name, handler);
    return [name, handler] as const;
  });
  watchParent?.(() => stop("SIGTERM"));
  try {
    try {
      for (let i = 0; i < count; i++) children.push(spawn(i));
    } catch (error) {
      // Those already started stop before the launcher reports the failure.
      stop("SIGTERM");
      await Promise.all(children.map((child) => child.status));
      throw error;
    }
    events.started(children.map((c) => c.pid));
    await Promise.all(children.map(async (child) => {
      const status = await child.status;
      if (!stopping) {
        // Not restarted (see the module comment): the others stop, and the launcher fails.
        events.lost(child.pid, status);
        code ||= status.code || 1;
        stop("SIGTERM");
      } else if (status.code !== 0) code ||= status.code || 1;
    }));
    return code;
  } finally {
    clearTimeout(killTimer);
    for (const [name, handler] of handlers) Deno.removeSignalListener(name, handler);
  }
}
