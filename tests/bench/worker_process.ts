/** The real `worker` process for benchmarks: `main.ts worker` with the permission set its task derives. */
import { parseConfig } from "../../src/config.ts";
import { permissionFlags } from "../../src/permissions.ts";

const MAIN = decodeURIComponent(new URL("../../main.ts", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../../migrations/", import.meta.url).pathname);
const TICK_MS = 10; // Linux USER_HZ: /proc/<pid>/stat counts CPU time in 1/100 s

/** CPU time (user + system) a process has used so far, in ms, from /proc. */
export async function cpuMs(pid: number): Promise<number> {
  // Deno treats /proc as privileged; `cat` (the bench may run programs) reads it for us.
  const out = await new Deno.Command("cat", { args: [`/proc/${pid}/stat`], stdout: "piped" }).output();
  const stat = new TextDecoder().decode(out.stdout);
  // Fields after the command name, which is in parentheses and may contain spaces.
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  return (Number(fields[11]) + Number(fields[12])) * TICK_MS;
}

/** A running service process. */
export interface WorkerProcess {
  pid: number;
  stop(): Promise<void>;
}

/** Starts a worker with `env` and resolves once it has logged `worker_started`. */
export function startWorkerProcess(env: Record<string, string>): Promise<WorkerProcess> {
  return startServiceProcess("worker", env, "worker_started");
}

/**
 * Starts `main.ts <command>` with the permission set its task derives from
 * `env`, and resolves once it has logged `readyEvent`.
 */
export async function startServiceProcess(
  command: "api" | "worker" | "relay",
  env: Record<string, string>,
  readyEvent: string,
): Promise<WorkerProcess> {
  const child = new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      ...permissionFlags(command, parseConfig(env), MIGRATIONS),
      // BENCH_CPU_PROF=DIR: each service process writes a V8 CPU profile there when it stops (for `--cpu-prof`).
      ...(Deno.env.get("BENCH_CPU_PROF") ? ["--cpu-prof", `--cpu-prof-dir=${Deno.env.get("BENCH_CPU_PROF")}`] : []),
      MAIN,
      command,
    ],
    env: { ...env, NO_COLOR: "1" },
    stdout: "null",
    stderr: "piped",
  }).spawn();
  const lines = child.stderr.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  const end = performance.now() + 30_000;
  while (!buffered.includes(`"${readyEvent}"`)) {
    const { value, done } = await lines.read();
    if (done || performance.now() > end) throw new Error(`${command} did not start: ${buffered.slice(-500)}`);
    buffered += value;
  }
  // Keep reading, or a full pipe would stall the process.
  const drained = (async () => {
    while (!(await lines.read()).done) { /* discard */ }
  })().catch(() => {});
  return {
    pid: child.pid,
    async stop() {
      child.kill("SIGTERM");
      await child.status;
      await drained;
    },
  };
}

/**
 * A fake model in its own process. `answersFile`: scripted answers by marker (see `model_server.ts`), read by the
 * process, which may read that file only.
 */
export async function startModelProcess(
  delayMs: number,
  { answersFile }: { answersFile?: string } = {},
): Promise<{ url: string; pid: number; stop(): Promise<void> }> {
  const child = new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      "--allow-net=127.0.0.1",
      ...(answersFile ? [`--allow-read=${answersFile}`] : []),
      new URL("./model_server.ts", import.meta.url).pathname,
      String(delayMs),
      ...(answersFile ? [answersFile] : []),
    ],
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  const { value } = await reader.read();
  const url = value?.trim() ?? "";
  if (!url.startsWith("http")) throw new Error(`model server did not start: ${value}`);
  return {
    url,
    pid: child.pid,
    async stop() {
      child.kill("SIGTERM");
      await child.status;
      await reader.cancel().catch(() => {});
    },
  };
}

/** The SDK alone against `url`: calls/s and CPU ms per call, measured after a warm-up. */
export async function sdkCeiling(url: string, concurrency: number, calls: number) {
  const child = new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      "--allow-net=127.0.0.1",
      "--allow-env",
      new URL("./sdk_ceiling.ts", import.meta.url).pathname,
      url,
      String(concurrency),
      String(calls),
    ],
    stdin: "piped",
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  let text = "";
  while (!text.includes("ready")) text += (await reader.read()).value ?? "";
  const before = await cpuMs(child.pid);
  const writer = child.stdin.getWriter();
  await writer.write(new TextEncoder().encode("go\n"));
  while (!/done [\d.]+/.test(text)) {
    const { value, done } = await reader.read();
    if (done) throw new Error("sdk ceiling exited early");
    text += value;
  }
  const after = await cpuMs(child.pid);
  const seconds = Number(/done ([\d.]+)/.exec(text)![1]);
  child.kill("SIGTERM");
  await child.status;
  await writer.close().catch(() => {});
  await reader.cancel().catch(() => {});
  return { perSecond: calls / seconds, cpuMsPerCall: (after - before) / calls };
}
