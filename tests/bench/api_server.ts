/**
 * The real API for the ingest rows, as an operator starts it: `deno task api`
 * (the launcher, then `main.ts api` with its derived permission set), or
 * `deno task api --parallel=N`. Its log lines go to a file, as to a log
 * shipper's: written (their cost is measured), never read by the bench.
 */
import { cpuMs } from "./worker_process.ts";
import { descendantsMatching } from "../support/process_tree.ts";

const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);

/** A running API deployment. */
export interface ApiServer {
  /** The API processes (one, or N with `--parallel=N`), for their CPU time. */
  pids: number[];
  /** CPU time (user + system) of every API process so far, in ms. */
  cpuMs(): Promise<number>;
  /** The peak resident memory of every API process so far, in MiB (`VmHWM`), summed. */
  peakRssMiB(): Promise<number>;
  stop(): Promise<void>;
}

/**
 * Starts `deno task api` (with `--parallel=N` when `parallel` is set) with `env`, in `root` (this checkout, or
 * another one to compare with), and resolves once every API process has logged `api_listening`.
 */
export async function startApi(
  env: Record<string, string>,
  { parallel, root = ROOT }: { parallel?: number; root?: string } = {},
) {
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
    cwd: root,
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
    // `main.ts api`, not the launcher (`main.ts launch api`).
    const pids = await descendantsMatching(child.pid, /main\.ts api\b/);
    if (pids.length !== expected) throw new Error(`expected ${expected} API processes, found ${pids.length}`);
    return {
      pids,
      async cpuMs() {
        let total = 0;
        for (const pid of pids) total += await cpuMs(pid);
        return total;
      },
      async peakRssMiB() {
        let kib = 0;
        for (const pid of pids) {
          const out = await new Deno.Command("cat", { args: [`/proc/${pid}/status`], stdout: "piped" }).output();
          kib += Number(/VmHWM:\s+(\d+) kB/.exec(new TextDecoder().decode(out.stdout))?.[1] ?? NaN);
        }
        return kib / 1024;
      },
      stop,
    } satisfies ApiServer;
  } catch (error) {
    await stop();
    throw error;
  }
}
