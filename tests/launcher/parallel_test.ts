/**
 * `deno task api --parallel=N` as deno.json runs it: N real API processes on
 * one port, each with the api's permission set, stopped together on SIGTERM,
 * and the launcher failing when one of them dies.
 */
import assert from "node:assert/strict";
import { MAX_PARALLEL, parallelArgs, superviseParallel } from "../../src/launcher/parallel.ts";
import { createTestDatabase, freePort, REDIS_URL, waitFor } from "../_support.ts";
import { emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { commandLine, descendantsMatching, isRunning } from "../support/process_tree.ts";

const ROOT = decodeURIComponent(new URL("../..", import.meta.url).pathname);

Deno.test("--parallel is one process per core, --parallel=N is N, anything else is refused by name", () => {
  assert.deepEqual(parallelArgs([], 4), { processes: undefined, rest: [] });
  assert.deepEqual(parallelArgs(["--parallel"], 4), { processes: 4, rest: [] });
  assert.deepEqual(parallelArgs(["--parallel"], 500), { processes: MAX_PARALLEL, rest: [] });
  assert.deepEqual(parallelArgs(["x", "--parallel=2", "y"], 4), { processes: 2, rest: ["x", "y"] });
  for (const bad of ["0", "-1", "1.5", "two", "", `${MAX_PARALLEL + 1}`]) {
    assert.throws(() => parallelArgs([`--parallel=${bad}`], 4), (e: TypeError) => e.message.includes(`"${bad}"`));
  }
});

/** A small Deno process running `code`; with `piped`, its stdout is the caller's to read. */
function script(code: string, { piped = false } = {}): Deno.ChildProcess {
  return new Deno.Command(Deno.execPath(), {
    args: ["eval", code],
    stdin: "null",
    stdout: piped ? "piped" : "null",
    stderr: "null",
  }).spawn();
}

/** Events of the supervisor, recorded. */
function recorded() {
  const seen: { started: number[][]; lost: [number, number][]; killed: number[] } = {
    started: [],
    lost: [],
    killed: [],
  };
  return {
    seen,
    events: {
      started: (pids: number[]) => void seen.started.push(pids),
      lost: (pid: number, status: Deno.CommandStatus) => void seen.lost.push([pid, status.code]),
      killed: (pid: number) => void seen.killed.push(pid),
    },
  };
}

Deno.test("a process that exits on its own stops the others, and the launcher exits 1 even when it exited 0", async () => {
  const { seen, events } = recorded();
  const code = await superviseParallel(
    (i) => script(i === 0 ? "setTimeout(() => Deno.exit(0), 200)" : "setInterval(() => {}, 1000)"),
    2,
    { events },
  );
  assert.equal(code, 1);
  assert.equal(seen.lost.length, 1);
  assert.equal(seen.lost[0]![1], 0);
  assert.deepEqual(seen.killed, [], "the other stopped on SIGTERM");
});

Deno.test("a process that ignores the stop is killed after the grace period, and the launcher fails", async () => {
  const { seen, events } = recorded();
  let orphaned = () => {};
  const stubborn = 'Deno.addSignalListener("SIGTERM", () => {}); console.log("ready"); setInterval(() => {}, 1000);';
  const children: Deno.ChildProcess[] = [];
  const supervised = superviseParallel(
    () => {
      children.push(script(stubborn, { piped: true }));
      return children.at(-1)!;
    },
    2,
    { events, watchParent: (onOrphaned) => orphaned = onOrphaned, killAfterMs: 300 },
  );
  // Each has its listener once it says so; then stop as if the launcher's parent were gone.
  for (const child of children) {
    const reader = child.stdout.getReader();
    await reader.read();
    reader.releaseLock();
  }
  orphaned();
  assert.notEqual(await supervised, 0);
  assert.deepEqual(seen.killed.sort(), [...seen.started[0]!].sort());
  for (const child of children) await child.stdout.cancel();
});

/** `deno task <args>` in the repository, its output piped. */
function task(args: string[], env: Record<string, string>) {
  return new Deno.Command(Deno.execPath(), {
    args: ["task", ...args],
    cwd: ROOT,
    env: { ...env, NO_COLOR: "1" },
    stdin: "null",
    stdout: "piped",
    stderr: "piped",
  }).spawn();
}

/** Collects a child's stderr as it comes, so a test can wait for lines while the process runs. */
function collect(child: Deno.ChildProcess) {
  let text = "";
  const done = child.stderr.pipeThrough(new TextDecoderStream()).pipeTo(
    new WritableStream({ write: (chunk) => void (text += chunk) }),
  );
  const events = (name: string) => text.split("\n").filter((l) => l.includes(`"event":"${name}"`));
  return { text: () => text, events, done };
}

Deno.test("api --parallel=2: two API processes with the api's permission set share the port and stop together", async (t) => {
  const db = await createTestDatabase();
  const env = { DATABASE_URL: db.url, REDIS_URL: await emptyRedisDatabase(REDIS_URL), LOG_LEVEL: "info" };
  try {
    await t.step("SIGTERM: every process stops gracefully and the launcher exits 0 within 10 s", async () => {
      const port = freePort();
      const child = task(["api", "--parallel=2"], { ...env, PORT: String(port) });
      const err = collect(child);
      try {
        await waitFor("two API processes listening", () => err.events("api_listening").length === 2, 30_000);
        const pids = err.events("api_listening").map((l) => JSON.parse(l).pid as number);
        assert.equal(new Set(pids).size, 2, "two processes");
        assert.deepEqual((await descendantsMatching(child.pid, /main\.ts api\b/)).sort(), [...pids].sort());
        for (const pid of pids) {
          const args = await commandLine(pid);
          // The api's own set: its listen address, Redis and Postgres; no -A, no write, and it runs only this Deno
          // binary (its validation children).
          assert.match(args, new RegExp(`--allow-net=[^ ]*127\\.0\\.0\\.1:${port}`));
          assert.doesNotMatch(args, / -A | --allow-all| --allow-write/);
          assert.deepEqual(args.match(/--allow-run\S*/g), [`--allow-run=${Deno.execPath()}`]);
          assert.match(args, /main\.ts api --reuse-port/);
        }
        // Both serve: the kernel spreads new connections across them.
        for (let i = 0; i < 20; i++) {
          const res = await fetch(`http://127.0.0.1:${port}/healthz`, { headers: { connection: "close" } });
          assert.equal(res.status, 200);
          await res.body?.cancel();
        }
        const started = performance.now();
        child.kill("SIGTERM");
        const status = await child.status;
        const elapsed = performance.now() - started;
        await err.done;
        assert.equal(status.code, 0, err.text().slice(-1_000));
        assert.ok(elapsed < 10_000, `stopped in ${elapsed.toFixed(0)} ms`);
        assert.equal(err.events("api_stopped").length, 2, "each process stopped gracefully");
        for (const pid of pids) assert.equal(await isRunning(pid), false, `process ${pid} is gone`);
      } finally {
        try {
          child.kill("SIGKILL");
        } catch { /* stopped */ }
        await child.status;
        await err.done.catch(() => {});
      }
    });

    await t.step("a process that dies is not restarted: the other stops gracefully, the launcher fails", async () => {
      const port = freePort();
      const child = task(["api", "--parallel=2"], { ...env, PORT: String(port) });
      const err = collect(child);
      try {
        await waitFor("two API processes listening", () => err.events("api_listening").length === 2, 30_000);
        const [victim, survivor] = err.events("api_listening").map((l) => JSON.parse(l).pid as number);
        const started = performance.now();
        Deno.kill(victim!, "SIGKILL");
        const status = await child.status;
        await err.done;
        assert.notEqual(status.code, 0, "the launcher fails");
        assert.ok(performance.now() - started < 10_000);
        const lost = err.events("api_process_exited").map((l) => JSON.parse(l));
        assert.equal(lost.length, 1);
        assert.equal(lost[0].pid, victim);
        assert.equal(err.events("api_stopped").length, 1, "the survivor stopped gracefully");
        assert.equal(await isRunning(survivor!), false);
      } finally {
        try {
          child.kill("SIGKILL");
        } catch { /* stopped */ }
        await child.status;
        await err.done.catch(() => {});
      }
    });

    await t.step("--parallel on another command, or a bad count, is refused at start with exit 2", async () => {
      for (
        const [args, message] of [
          [["worker", "--parallel"], /--parallel applies to the api only/],
          [["api", "--parallel=0"], /--parallel must be a number of processes from 1 to 64 \(got "0"\)/],
        ] as const
      ) {
        const out = await new Deno.Command(Deno.execPath(), {
          args: ["task", ...args],
          cwd: ROOT,
          env: { ...env, NO_COLOR: "1", PORT: String(freePort()) },
          stdout: "piped",
          stderr: "piped",
        }).output();
        assert.equal(out.code, 2, args.join(" "));
        assert.match(new TextDecoder().decode(out.stderr), message);
      }
    });
  } finally {
    await releaseRedisDatabase(env.REDIS_URL);
    await db.close();
  }
});
