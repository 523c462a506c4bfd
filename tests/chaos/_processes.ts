/**
 * The service processes of a chaos run: `main.ts <task>` started as `deno task <task>` would start it (with the
 * permission set the task derives), each logging to a file of its own, watched for its start line, and told apart
 * when it exits: killed by the run, or on its own (a failure).
 */
import { sleep } from "../../src/async/timeout.ts";
import type { Command } from "../../src/commands.ts";
import type { Config } from "../../src/config.ts";
import { permissionFlags } from "../../src/permissions.ts";

/** The service's entry point and its migrations, as the tasks name them. */
export const MAIN = decodeURIComponent(new URL("../../main.ts", import.meta.url).pathname);
export const MIGRATIONS = decodeURIComponent(new URL("../../migrations/", import.meta.url).pathname);

/**
 * What `deno task <task>` runs for `config`: main.ts with the permission set derived from the configured URLs.
 * Started directly (not through the launcher), so a SIGKILL hits the service process itself.
 */
export function taskArgsOf(task: Command, config: Config): string[] {
  return ["run", ...permissionFlags(task, config, MIGRATIONS), MAIN, task];
}

/** One service process. */
export interface Proc {
  name: string;
  task: Command;
  child: Deno.ChildProcess;
  /** Settles once the process has logged its start (the API listens; a worker has its Redis connection). */
  started: Promise<void>;
  /** Settles once both pipes are drained into the log file and its handles closed (and so flushed). */
  logged: Promise<unknown>;
}

/** The line each process logs once it is up: the API listening, a worker connected, a relay running. */
export const START_EVENT = /"event":"(api_listening|worker_started|relay_started)"/;

/** Passes a process's log through unchanged, and calls `onStart` once its start line has gone by. */
export function startWatch(onStart: () => void): TransformStream<Uint8Array, Uint8Array> {
  const decoder = new TextDecoder();
  let tail = "", seen = false;
  return new TransformStream({
    transform(chunk, controller) {
      if (!seen) {
        const text = tail + decoder.decode(chunk, { stream: true });
        // The end of this chunk is kept, in case the start line straddles two.
        tail = text.slice(-100);
        seen = START_EVENT.test(text);
        if (seen) onStart();
      }
      controller.enqueue(chunk);
    },
  });
}

/** Starts the run's processes, and keeps which it killed and which exited on their own. */
export interface Spawner {
  /** Starts `main.ts <task>` as `name` (its log: `<logDir>/<name>.log`, appended to across restarts). */
  spawn(name: string, task: Command): Promise<Proc>;
  /** Children the run killed (or stopped) on purpose: add one before killing it. */
  readonly killedByUs: Set<Deno.ChildProcess>;
  /** Processes that exited without being killed by the run, as `name (exit N)`. */
  readonly selfExits: string[];
}

/** A {@linkcode Spawner} whose processes get `env` and the arguments `argsOf` their task. */
export function createSpawner(
  { logDir, env, argsOf }: {
    logDir: string;
    env: Record<string, string>;
    argsOf: (task: Command) => string[] | Promise<string[]>;
  },
): Spawner {
  const killedByUs = new Set<Deno.ChildProcess>();
  const selfExits: string[] = [];
  return {
    killedByUs,
    selfExits,
    async spawn(name, task) {
      const open = () => Deno.open(`${logDir}/${name}.log`, { append: true, create: true });
      const [out, err] = [await open(), await open()];
      const child = new Deno.Command(Deno.execPath(), {
        args: await argsOf(task),
        env,
        stdout: "piped",
        stderr: "piped",
      }).spawn();
      let markStarted!: () => void;
      const started = new Promise<void>((resolve) => (markStarted = resolve));
      // Keep the pipes drained into the log file (a full pipe would stall the process). One handle per pipe: a
      // handle's writable takes one writer, so a second pipeTo onto it fails at once and leaves that pipe undrained,
      // and the service logs to stderr: after 64 KiB its next line blocks it for good, deaf even to SIGTERM. Each
      // pipe closes its handle when the process is gone; the writable buffers, and only that close writes out the
      // rest.
      const logged = Promise.all([
        child.stdout.pipeTo(out.writable).catch(() => {}),
        child.stderr.pipeThrough(startWatch(markStarted)).pipeTo(err.writable).catch(() => {}),
      ]);
      child.status.then((status) => {
        if (!killedByUs.has(child)) selfExits.push(`${name} (exit ${status.code})`);
      });
      return { name, task, child, started, logged };
    },
  };
}

/**
 * Waits until the API on `port` answers `/healthz` 200.
 * @throws {Error} after `timeoutMs`, naming `logDir`'s API log.
 */
export async function apiHealthy(port: number, timeoutMs: number, logDir: string): Promise<void> {
  const end = performance.now() + timeoutMs;
  while (performance.now() < end) {
    try {
      const res = await fetch(`http://127.0.0.1:${port}/healthz`);
      await res.body?.cancel();
      if (res.ok) return;
    } catch { /* not yet */ }
    await sleep(100);
  }
  throw new Error(`the API did not come up; see ${logDir}/api.log`);
}

/**
 * Stops `procs` with SIGTERM. Each process promises to exit within 10 s of it: one that has not after 15 s is
 * SIGKILLed. @returns the names of those (each a failure of the run).
 */
export async function stopAll(procs: readonly Proc[], killedByUs: Set<Deno.ChildProcess>): Promise<string[]> {
  for (const p of procs) {
    killedByUs.add(p.child);
    p.child.kill("SIGTERM");
  }
  const stuck: string[] = [];
  await Promise.all(procs.map(async (p) => {
    const bound = new AbortController();
    const stopped = await Promise.race([
      p.child.status.then(() => true),
      sleep(15_000, bound.signal).then(() => false, () => true),
    ]);
    bound.abort();
    if (stopped) return;
    stuck.push(p.name);
    p.child.kill("SIGKILL");
    await p.child.status;
  }));
  await Promise.all(procs.map((p) => p.logged));
  return stuck;
}

/**
 * A number option of a chaos harness, `--name N`: `fallback` when absent; exits 2 naming the option when its value
 * is not a number of at least 0.
 */
export function numberOption(args: readonly string[], name: string, fallback: number): number {
  const i = args.indexOf(`--${name}`);
  const value = i >= 0 ? Number(args[i + 1]) : fallback;
  if (!Number.isFinite(value) || value < 0) {
    console.error(`--${name} must be a number (got ${JSON.stringify(args[i + 1])})`);
    Deno.exit(2);
  }
  return value;
}
