/**
 * The real API for the ingest rows, as an operator starts it: `deno task api`
 * (the launcher, then `main.ts api` with its derived permission set), or
 * `deno task api --parallel=N`. Its log lines go to a file, as to a log
 * shipper's: written (their cost is measured), never read by the bench.
 */
import { cpuMs } from "./worker_process.ts";

const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);

/** A running API deployment. */
export interface ApiServer {
  /** The API processes (one, or N with `--parallel=N`), for their CPU time. */
  pids: number[];
  /** CPU time (user + system) of every API process so far, in ms. */
  cpuMs(): Promise<number>;
  stop(): Promise<void>;
}

/** The pids of the processes whose parent is `pid`. */
async function childrenOf(pid: number): Promise<number[]> {
  const out = await new Deno.Command("ps", { args: ["-o", "pid=", "--ppid", String(pid)], stdout: "piped" }).output();
  return new TextDecoder().decode(out.stdout).split("\n").map((s) => Number(s.trim())).filter((n) => n > 0);
}

/** The command line of `pid`, its arguments separated by spaces. */
async function commandLine(pid: number): Promise<string> {
  const out = await new Deno.Command("cat", { args: [`/proc/${pid}/cmdline`], stdout: "piped" }).output();
  return new TextDecoder().decode(out.stdout).replaceAll("\0", " ");
}

/** Every process below `pid` that runs `main.ts api` (not the launcher, `main.ts launch api`). */
async function apiProcesses(pid: number): Promise<number[]> {
  const found: number[] = [];
  for (const child of await childrenOf(pid)) {
    if (/main\.ts api\b/.test(await commandLine(child))) found.push(child);
    else found.push(...await apiProcesses(child));
  }
  return found;
}

/**
 * Starts `deno task api` (with `--parallel=N` when `parallel` is set) with `env`, and resolves once every API
 * process has logged `api_listening`.
 */
export async function startApi(env: Record<string, string>, { parallel }: { parallel?: number } = {}) {
  const logFile = await Deno.makeTempFile({ prefix: "oncely-bench-api-", suffix: ".log" });
  const expected = parallel ?? 1;
  const child = new Deno.Command("sh", {
    args: [
      "-c",
      'exec "$0" "$@" 2>"$ONCELY_BENCH_LOG"',
      Deno.execPath(),
      "task",
      "api",
      ...(parallel ? [`--parallel=${parallel}`] : []),
    ],
    cwd: ROOT,
    env: { ...env, NO_COLOR: "1", ONCELY_BENCH_LOG: logFile },
    stdout: "null",
    stdin: "null",
  }).spawn();
  const stop = async () => {
    try {
      child.kill("SIGTERM");
    } catch { /* already gone */ }
    await child.status;
    await Deno.remove(logFile).catch(() => {});
  };
  try {
    const end = performance.now() + 60_000;
    for (;;) {
      const log = await Deno.readTextFile(logFile);
      if ((log.match(/"api_listening"/g) ?? []).length >= expected) break;
      if (performance.now() > end) throw new Error(`the API did not start: ${log.slice(-500)}`);
      await new Promise((r) => setTimeout(r, 100));
    }
    const pids = await apiProcesses(child.pid);
    if (pids.length !== expected) throw new Error(`expected ${expected} API processes, found ${pids.length}`);
    return {
      pids,
      async cpuMs() {
        let total = 0;
        for (const pid of pids) total += await cpuMs(pid);
        return total;
      },
      stop,
    } satisfies ApiServer;
  } catch (error) {
    await stop();
    throw error;
  }
}
