/**
 * The real tasks as subprocesses, exactly as deno.json runs them (a launcher
 * that derives each process's permission set from its configured URLs):
 * graceful stop on SIGTERM within 10 s, a host outside a process's set named
 * at start-up, and the runtime refusing what a set does not allow.
 */
import assert from "node:assert/strict";
import { Redis } from "ioredis";
import { parseConfig } from "../src/config.ts";
import type { Command } from "../src/commands.ts";
import { permissionFlags } from "../src/permissions.ts";
import { createApiKey } from "../src/tenants/tenant_store.ts";
import { startFakeMail } from "./support/fake_mail_server.ts";
import { startFakeModel } from "./support/fake_model_server.ts";
import { enqueueToLane } from "./support/enqueue.ts";
import { serviceKeys } from "../src/runs/keys.ts";
import { createTestDatabase, freePort, REDIS_URL, waitFor } from "./_support.ts";
import { emptyRedisDatabase, releaseRedisDatabase } from "./support/scratch.ts";

const tasks = JSON.parse(await Deno.readTextFile(new URL("../deno.json", import.meta.url))).tasks as Record<
  string,
  string
>;

const ROOT = decodeURIComponent(new URL("..", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../migrations/", import.meta.url).pathname);

/** The task's own command line from deno.json. */
function taskArgs(name: string): string[] {
  const args = tasks[name]!.split(/\s+/);
  assert.equal(args[0], "deno");
  assert.ok(!args.includes("-A") && !args.some((a) => a.startsWith("--allow-all")), "no task runs with -A");
  return args.slice(1);
}

function spawn(args: string[], env: Record<string, string>) {
  return new Deno.Command(Deno.execPath(), { args, env, cwd: ROOT, stdout: "piped", stderr: "piped" }).spawn();
}

async function stopAndWait(child: Deno.ChildProcess) {
  const started = performance.now();
  child.kill("SIGTERM");
  const status = await child.status;
  const [out, err] = await Promise.all([new Response(child.stdout).text(), new Response(child.stderr).text()]);
  return { status, elapsed: performance.now() - started, out, err };
}

Deno.test("processes", async (t) => {
  const db = await createTestDatabase();
  // The real processes use the service's fixed key names, so they get a Redis database nobody else uses.
  const redisUrl = await emptyRedisDatabase(REDIS_URL);
  const redis = new Redis(redisUrl);
  const mail = startFakeMail();
  const env = {
    DATABASE_URL: db.url,
    REDIS_URL: redisUrl,
    LOG_LEVEL: "info",
    NO_COLOR: "1",
  };
  try {
    await redis.flushdb();
    await t.step("api, worker and relay run a job end to end and each exits 0 within 10 s of SIGTERM", async () => {
      const port = freePort();
      const key = await createApiKey(db.sql, "acme");
      const api = spawn(taskArgs("api"), { ...env, PORT: String(port) });
      const worker = spawn(taskArgs("worker"), env);
      const relay = spawn(taskArgs("relay"), {
        ...env,
        RESEND_API_KEY: "re_test",
        RESEND_BASE_URL: mail.url,
      });
      try {
        await waitFor(
          "the API",
          () => fetch(`http://127.0.0.1:${port}/healthz`).then((r) => r.ok, () => false),
          15_000,
        );
        const res = await fetch(`http://127.0.0.1:${port}/v1/summaries`, {
          method: "POST",
          headers: {
            authorization: `Bearer ${key}`,
            "idempotency-key": "process-test-0001",
            "content-type": "application/json",
          },
          body: JSON.stringify({ text: "Revenue rose. Costs fell. The plan was approved.", notify: "ops@example.com" }),
        });
        assert.equal(res.status, 202);
        const { job_id } = await res.json();
        await waitFor("the email", () => mail.delivered.length === 1, 15_000);
        assert.equal(mail.delivered[0]!.idempotencyKey, `summary_ready:${job_id}`);
      } finally {
        for (const [name, child] of [["api", api], ["worker", worker], ["relay", relay]] as const) {
          const { status, elapsed, err } = await stopAndWait(child);
          assert.equal(status.code, 0, `${name} exit code; stderr: ${err.slice(-500)}`);
          assert.ok(elapsed < 10_000, `${name} stopped in ${elapsed.toFixed(0)} ms`);
          assert.match(err, /shutdown_requested/);
        }
      }
    });

    await t.step("if the launcher is SIGKILLed, the process it started stops instead of running orphaned", async () => {
      const port = freePort();
      const api = spawn(taskArgs("api"), { ...env, PORT: String(port) });
      const up = () => fetch(`http://127.0.0.1:${port}/healthz`).then((r) => (r.body?.cancel(), r.ok), () => false);
      await waitFor("the API", up, 15_000);
      api.kill("SIGKILL");
      await api.status;
      await waitFor("the orphan to stop", async () => !(await up()), 5_000);
      await Promise.all([api.stdout.cancel(), api.stderr.cancel()]);
    });

    await t.step("run with a set that lacks a configured host, a process names it at start-up", async () => {
      // main.ts run directly with the default hosts' set (as a compiled binary is), but a different model host.
      const flags = permissionFlags("worker", parseConfig({ OPENAI_API_KEY: "sk-test" }), MIGRATIONS);
      const out = await new Deno.Command(Deno.execPath(), {
        args: ["run", ...flags, "main.ts", "worker"],
        cwd: ROOT,
        env: { ...env, OPENAI_API_KEY: "sk-test", OPENAI_BASE_URL: mail.url },
        stdout: "piped",
        stderr: "piped",
      }).output();
      assert.equal(out.code, 2);
      const stderr = new TextDecoder().decode(out.stderr).trim();
      assert.match(stderr, new RegExp(`OPENAI_BASE_URL needs network access to ${new URL(mail.url).host}`));
    });

    await t.step("each process's permission set refuses what it does not use, at the runtime level", async () => {
      const mailPort = new URL(mail.url).port;
      const config = parseConfig({ ...env, OPENAI_API_KEY: "sk", RESEND_API_KEY: "re" });
      // Outside the api and worker sets: the fake provider's port. Outside the api's: a model host.
      const cases: [Command, string][] = [
        ["api", `await fetch("http://127.0.0.1:${mailPort}/emails", { method: "POST" });`],
        ["api", `await fetch("https://api.openai.com/v1/models");`],
        ["worker", `await fetch("http://127.0.0.1:${mailPort}/emails", { method: "POST" });`],
        ["worker", `await fetch("https://api.resend.com/emails");`],
        // The relay reaches any host (webhook receivers) but Redis and the cloud metadata address.
        ["relay", `await Deno.connect({ hostname: "127.0.0.1", port: 6379 });`],
        ["relay", `await Deno.connect({ hostname: "169.254.169.254", port: 80 });`],
        ["relay", `Deno.env.get("HOME");`],
      ];
      const probe = await Deno.makeTempFile({ suffix: ".ts" });
      try {
        for (const [task, code] of cases) {
          await Deno.writeTextFile(probe, code);
          const flags = permissionFlags(task, config, MIGRATIONS);
          const out = await new Deno.Command(Deno.execPath(), {
            args: ["run", ...flags, probe],
            stdout: "piped",
            stderr: "piped",
          }).output();
          const stderr = new TextDecoder().decode(out.stderr);
          if (code.includes("HOME")) {
            // --ignore-env: an unlisted variable reads as unset instead of being disclosed.
            assert.equal(out.code, 0, stderr);
            continue;
          }
          assert.notEqual(out.code, 0, `${task}: ${code}`);
          assert.match(stderr, /NotCapable|Requires net access/, `${task}: ${code}`);
        }
      } finally {
        await Deno.remove(probe);
      }
      assert.equal(mail.requests, 1, "the fake provider saw only the real send");
    });

    await t.step(
      "SIGTERM with a job stuck in a hung model call: the worker exits 0 within 10 s, the job stays pending",
      async () => {
        const model = startFakeModel(() => ({ kind: "hang" }));
        const keys = serviceKeys("oncely");
        const lane = keys.lane("acme");
        const worker = spawn(taskArgs("worker"), {
          ...env,
          OPENAI_API_KEY: "sk-test",
          OPENAI_BASE_URL: model.url,
          LLM_CALL_TIMEOUT_S: "30",
          JOB_BUDGET_S: "60",
        });
        try {
          await enqueueToLane(redis, keys, {
            jobId: crypto.randomUUID(),
            tenant: "acme",
            request: { text: "Revenue rose.", notify: "a@b.co" },
          });
          await waitFor("the model call", () => model.requests === 1, 15_000);
          const { status, elapsed, err } = await stopAndWait(worker);
          assert.equal(status.code, 0, err.slice(-500));
          assert.ok(elapsed < 10_000, `stopped in ${elapsed.toFixed(0)} ms`);
          assert.match(err, /worker_abandoned_in_flight/);
          const [pending] = await redis.xpending(lane.stream, lane.group) as [number];
          assert.equal(pending, 1, "the abandoned job is still pending, for another worker to reclaim");
        } finally {
          await model.close();
        }
      },
    );

    await t.step("the worker serves /metrics on METRICS_PORT", async () => {
      const port = freePort();
      const worker = spawn(taskArgs("worker"), {
        ...env,
        METRICS_PORT: String(port),
      });
      try {
        const text = await waitFor(
          "metrics",
          () => fetch(`http://127.0.0.1:${port}/metrics`).then((r) => (r.ok ? r.text() : null), () => null),
          15_000,
        );
        assert.match(text, /^# TYPE oncely_worker_deliveries_total counter$/m);
        assert.match(text, /^oncely_queue_lag \d+/m);
      } finally {
        const { status } = await stopAndWait(worker);
        assert.equal(status.code, 0);
      }
    });
  } finally {
    await redis.quit();
    await releaseRedisDatabase(redisUrl);
    await mail.close();
    await db.close();
  }
});
