/**
 * The launcher (`main.ts launch`, behind every `deno task`) is the one
 * process that may start others, so it is kept small: it loads only what
 * parses the configuration, and it may run only the Deno binary that runs
 * it, never a `deno` found on PATH.
 */
import assert from "node:assert/strict";
import { createTestDatabase, REDIS_URL } from "./_support.ts";
import { deployment, deploymentsEnv } from "./support/deployments_env.ts";

const ROOT = decodeURIComponent(new URL("..", import.meta.url).pathname);
const MAIN = new URL("../main.ts", import.meta.url).href;
const tasks = JSON.parse(await Deno.readTextFile(new URL("../deno.json", import.meta.url))).tasks as Record<
  string,
  string
>;

interface GraphModule {
  specifier: string;
  dependencies?: { code?: { specifier: string }; isDynamic?: boolean }[];
}

/** Every module `main.ts` loads before it runs a line: static, non-type imports only. */
async function staticGraph(): Promise<Set<string>> {
  const out = await new Deno.Command(Deno.execPath(), { args: ["info", "--json", "main.ts"], cwd: ROOT }).output();
  assert.ok(out.success, new TextDecoder().decode(out.stderr));
  const modules = new Map<string, GraphModule>();
  for (const m of JSON.parse(new TextDecoder().decode(out.stdout)).modules as GraphModule[]) {
    modules.set(m.specifier, m);
  }
  const seen = new Set<string>();
  const visit = (specifier: string) => {
    if (seen.has(specifier)) return;
    seen.add(specifier);
    for (const dep of modules.get(specifier)?.dependencies ?? []) {
      if (dep.code && !dep.isDynamic) visit(dep.code.specifier);
    }
  };
  visit(MAIN);
  return seen;
}

Deno.test("the launcher loads the configuration's parser and nothing of the service", async () => {
  const loaded = [...await staticGraph()];
  const ours = loaded.filter((s) => s.startsWith("file:")).map((s) => s.slice(new URL(ROOT, "file:").href.length));
  assert.deepEqual(ours.sort(), [
    "main.ts",
    "src/commands.ts",
    "src/config.ts",
    "src/launcher/parallel.ts", // supervises `api --parallel`; imports nothing
    "src/llm/prices.ts", // parses LLM_PRICES; imports nothing
    "src/log/logger.ts",
    "src/permissions.ts",
  ]);
  const packages = loaded.filter((s) => s.startsWith("npm:")).map((s) => /^npm:\/?(@?[^@]+)/.exec(s)![1]);
  assert.deepEqual([...new Set(packages)], ["zod"], "only zod, which parses the configuration");
});

Deno.test("the launcher spawns Deno.execPath(), and its permission set allows nothing else", async () => {
  const db = await createTestDatabase({ migrate: false });
  const decoy = await Deno.makeTempDir();
  try {
    // A `deno` earlier on PATH that would leave a mark if the launcher ran it.
    await Deno.writeTextFile(`${decoy}/deno`, `#!/bin/sh\ntouch "${decoy}/ran"\nexit 3\n`, { mode: 0o755 });
    const env = { PATH: `${decoy}:${Deno.env.get("PATH")}`, DATABASE_URL: db.url, NO_COLOR: "1" };
    // The launch task as deno.json has it, run by this binary (so its `$(deno eval ...)` names this binary).
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["task", "migrate"],
      cwd: ROOT,
      env,
      stdout: "piped",
      stderr: "piped",
    }).output();
    const stderr = new TextDecoder().decode(out.stderr);
    assert.equal(out.code, 0, stderr);
    await assert.rejects(Deno.stat(`${decoy}/ran`), Deno.errors.NotFound, "the PATH decoy never ran");
    const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM oncely_migrations`;
    assert.ok(row!.n > 0, "the real migrate ran");

    // With the same set, a script that tries the PATH `deno` is refused by the runtime.
    const allowRun = /--allow-run="\$\((.+)\)"/.exec(tasks.launch!)![1]!;
    assert.match(allowRun, /Deno\.execPath\(\)/);
    const script = `${decoy}/probe.ts`;
    await Deno.writeTextFile(script, `await new Deno.Command("deno", { args: ["--version"] }).output();`);
    const probe = await new Deno.Command(Deno.execPath(), {
      args: ["run", "--no-config", `--allow-run=${Deno.execPath()}`, script],
      env,
      stderr: "piped",
    }).output();
    assert.notEqual(probe.code, 0);
    assert.match(new TextDecoder().decode(probe.stderr), /NotCapable|Requires run access/);
  } finally {
    await Deno.remove(decoy, { recursive: true });
    await db.close();
  }
});

Deno.test("behind Sentinel, the relay is not launched when no sentinel names the Redis nodes it must deny", async () => {
  const { launchFlags } = await import("../main.ts");
  const { parseConfig, ConfigError } = await import("../src/config.ts");
  // Nothing listens on port 1: the probe finds no master and no replica.
  const config = parseConfig({ REDIS_URL: "redis+sentinel://127.0.0.1:1/mymaster" });
  await assert.rejects(launchFlags("relay", config), (error: unknown) => {
    assert.ok(error instanceof ConfigError);
    assert.match(error.message, /^Cannot start: no sentinel in REDIS_URL named the Redis master/);
    return true;
  });
  // A process that only uses Redis still starts: its client finds the nodes itself once a sentinel answers.
  const flags = await launchFlags("worker", config);
  assert.ok(flags.some((f) => f.startsWith("--allow-net=") && f.includes("127.0.0.1:1")));
});

Deno.test("the launch task reads any LLM_KEY_ variable a deployment names, and its process may read it too", async () => {
  const db = await createTestDatabase({ migrate: false });
  try {
    const task = (env: Record<string, string>) =>
      new Deno.Command(Deno.execPath(), {
        args: ["task", "migrate"],
        cwd: ROOT,
        env: { ...env, DATABASE_URL: db.url, NO_COLOR: "1" },
        clearEnv: true,
        stdout: "piped",
        stderr: "piped",
      }).output();
    const path = { PATH: Deno.env.get("PATH") ?? "", HOME: Deno.env.get("HOME") ?? "" };
    // The launcher's static --allow-env has LLM_KEY_*: without it (with --ignore-env) the key would read as unset.
    const ok = await task({ ...path, ...deploymentsEnv([deployment("east"), deployment("azure-west")]) });
    assert.equal(ok.code, 0, new TextDecoder().decode(ok.stderr));
    const unset = await task({ ...path, LLM_DEPLOYMENTS: JSON.stringify([deployment("east")]) });
    assert.equal(unset.code, 2);
    assert.match(new TextDecoder().decode(unset.stderr), /Cannot start: LLM_KEY_EAST is not set, and LLM_DEPLOYMENTS/);
  } finally {
    await db.close();
  }
});

Deno.test("the Redis probe starts with deployments configured: it reads REDIS_URL, no key", async () => {
  const { parseConfig } = await import("../src/config.ts");
  const { redisProbeFlags } = await import("../src/permissions.ts");
  const env = { ...deploymentsEnv([deployment("east")]), REDIS_URL };
  // Its flags grant the service's variables only: were it to parse the whole configuration, the key would be unset.
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", ...redisProbeFlags(parseConfig(env)), "main.ts", "redis-nodes"],
    cwd: ROOT,
    env,
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
});
