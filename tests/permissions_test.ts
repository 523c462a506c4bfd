/**
 * The read grants of the permission sets: the processes that validate
 * against tenants' schemas may read the validation Worker's and the
 * definition check Worker's modules, and nothing more; the rest read nothing but the migrations where they migrate.
 * And the network grants for Redis behind Sentinel, and for the model deployments with their key variables.
 */
import assert from "node:assert/strict";
import { CONFIG_VARIABLES, parseConfig, parseSentinelUrl } from "../src/config.ts";
import { COMMAND_TABLE, COMMANDS } from "../src/commands.ts";
import {
  DEFINITION_WORKER,
  DEFINITION_WORKER_FILES,
  envVariables,
  permissionFlags,
  redisHostNames,
  redisProbeFlags,
  requiredHosts,
  VALIDATION_WORKER,
  VALIDATION_WORKER_FILES,
  withRedisAddresses,
  withRedisHosts,
  WORKER_FILES,
} from "../src/permissions.ts";

import { deployment, deploymentsEnv } from "./support/deployments_env.ts";

const ROOT = decodeURIComponent(new URL("..", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../migrations/", import.meta.url).pathname);

Deno.test("api, worker and dev may run this Deno binary (their validation children); no other command runs anything", () => {
  const config = parseConfig({});
  for (const command of COMMANDS) {
    const runs = permissionFlags(command, config, MIGRATIONS).filter((flag) => flag.startsWith("--allow-run"));
    const validates = ["api", "worker", "dev"].includes(command);
    assert.deepEqual(runs, validates ? [`--allow-run=${Deno.execPath()}`] : [], command);
    const reads = permissionFlags(command, config, MIGRATIONS).find((flag) => flag.startsWith("--allow-read="));
    assert.ok(!reads?.includes("validation_worker.ts"), `${command} reads no Worker module`);
  }
});

Deno.test("compiled, api, worker and dev may read the Workers' modules; no other command reads them", () => {
  const config = parseConfig({});
  const reads = Object.fromEntries(COMMANDS.map((command) => {
    const flags = permissionFlags(command, config, MIGRATIONS, { binary: true })
      .filter((flag) => flag.startsWith("--allow-read"));
    assert.ok(flags.length <= 1, `${command}: one --allow-read`);
    return [command, flags[0]?.slice("--allow-read=".length).split(",") ?? []];
  }));
  assert.deepEqual(reads, {
    api: WORKER_FILES,
    worker: WORKER_FILES,
    relay: [],
    dev: [MIGRATIONS, ...WORKER_FILES],
    migrate: [MIGRATIONS],
    tenant: [],
    dlq: [],
    outbox: [],
    provider: [],
    tasks: [],
    usage: [],
    batches: [],
  });
});

for (
  const [what, worker, files] of [
    ["validation", VALIDATION_WORKER, VALIDATION_WORKER_FILES],
    ["definition check", DEFINITION_WORKER, DEFINITION_WORKER_FILES],
  ] as const
) {
  Deno.test(`the ${what} Worker's read grant is exactly its module graph's local files`, async () => {
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["info", "--json", worker],
      cwd: ROOT,
      stdout: "piped",
    }).output();
    assert.ok(out.success);
    const local = (JSON.parse(new TextDecoder().decode(out.stdout)).modules as { specifier: string }[])
      .map((m) => m.specifier)
      .filter((specifier) => specifier.startsWith("file:"))
      .map((specifier) => decodeURIComponent(new URL(specifier).pathname));
    const covers = (grant: string, path: string) => path === grant || path.startsWith(`${grant}/`);
    for (const path of local) {
      assert.ok(files.some((grant) => covers(grant, path)), `${path} is granted`);
    }
    for (const grant of files) {
      const inside = (await Deno.stat(grant)).isDirectory
        ? [...Deno.readDirSync(grant)].map((entry) => `${grant}/${entry.name}`)
        : [grant];
      for (const path of inside) assert.ok(local.includes(path), `${path} is granted but the Worker never loads it`);
    }
  });
}

Deno.test("REDIS_URL behind Sentinel: the sentinels, then the nodes the launcher found, are granted to Redis users", () => {
  const config = parseConfig({
    REDIS_URL: "redis+sentinel://u:p@10.0.0.1:26380,sentinel-b/mymaster/2",
    DATABASE_URL: "postgres://postgres@db:5432/postgres",
  });
  const allowNet = (c: typeof config, command: "api" | "worker") =>
    permissionFlags(command, c, MIGRATIONS).find((f) => f.startsWith("--allow-net="));
  assert.equal(allowNet(config, "api"), "--allow-net=10.0.0.1:26380,sentinel-b:26379,db:5432,127.0.0.1:8000");
  assert.deepEqual(redisProbeFlags(config)[0], "--allow-net=10.0.0.1:26380,sentinel-b:26379");

  // What the probe (`main.ts redis-nodes`) reports joins the URL's hosts, and the URL still parses the same.
  const found = withRedisHosts(config, ["10.0.0.7:6379", "[fd00::8]:6379", "10.0.0.3:26379"]);
  assert.equal(
    found.REDIS_URL,
    "redis+sentinel://u:p@10.0.0.1:26380,sentinel-b,10.0.0.7:6379,[fd00::8]:6379,10.0.0.3:26379/mymaster/2",
  );
  assert.deepEqual(
    { ...parseSentinelUrl(found.REDIS_URL), sentinels: [] },
    { ...parseSentinelUrl(config.REDIS_URL), sentinels: [] },
  );
  assert.equal(
    allowNet(found, "worker"),
    "--allow-net=10.0.0.1:26380,sentinel-b:26379,10.0.0.7:6379,[fd00::8]:6379,10.0.0.3:26379,db:5432",
  );

  // The relay may reach any host but these: every sentinel and node, by name and by the addresses resolved.
  const relay = withRedisAddresses(found, { "sentinel-b": ["10.0.0.2"] });
  const denied = permissionFlags("relay", relay, MIGRATIONS).find((f) => f.startsWith("--deny-net="))!.split(/[=,]/);
  for (const host of ["10.0.0.1:26380", "sentinel-b:26379", "10.0.0.2:26379", "10.0.0.7:6379", "[fd00::8]:6379"]) {
    assert.ok(denied.includes(host), `${host} is denied to the relay`);
  }
  assert.deepEqual(redisHostNames(found), ["sentinel-b"]);
});

Deno.test("LLM_DEPLOYMENTS: each deployment's server is granted to the commands that call the model, and only those", () => {
  const config = parseConfig(deploymentsEnv([
    deployment("east", { base_url: "https://east.example.com/v1" }),
    deployment("local", { base_url: "http://10.0.0.5:8080/v1", api_key_env: "OPENAI_API_KEY" }),
  ], { OPENAI_BASE_URL: "https://api.openai.com/v1", DATABASE_URL: "postgres://postgres@db:5432/postgres" }));
  assert.deepEqual(requiredHosts(config, { model: true }), {
    "LLM_DEPLOYMENTS[east]": "east.example.com:443",
    "LLM_DEPLOYMENTS[local]": "10.0.0.5:8080",
  }, "OPENAI_BASE_URL names no deployment then");
  const allowNet = (command: (typeof COMMANDS)[number]) =>
    permissionFlags(command, config, MIGRATIONS).find((f) => f.startsWith("--allow-net="))?.slice(12).split(",");
  assert.deepEqual(allowNet("worker"), ["127.0.0.1:6379", "db:5432", "east.example.com:443", "10.0.0.5:8080"]);
  for (const command of COMMANDS.filter((c) => !COMMAND_TABLE[c].net.model && !COMMAND_TABLE[c].net.anyHost)) {
    const hosts = allowNet(command) ?? [];
    assert.ok(!hosts.includes("east.example.com:443") && !hosts.includes("10.0.0.5:8080"), command);
  }
  // dev reaches any host but Redis and the metadata endpoints: the deployments among them.
  assert.ok(permissionFlags("dev", config, MIGRATIONS).includes("--allow-net"));
});

Deno.test("LLM_DEPLOYMENTS: every command may read the key variables its deployments name, and no other", () => {
  const config = parseConfig(deploymentsEnv([
    deployment("east"),
    deployment("west"),
    deployment("spare", { api_key_env: "LLM_KEY_EAST" }),
  ]));
  assert.deepEqual(envVariables(config), [...CONFIG_VARIABLES, "LLM_KEY_EAST", "LLM_KEY_WEST"]);
  for (const command of COMMANDS) {
    for (const binary of [false, true]) {
      const env = permissionFlags(command, config, MIGRATIONS, { binary }).find((f) => f.startsWith("--allow-env="))!;
      const names = env.slice("--allow-env=".length).split(",");
      assert.ok(names.includes("LLM_KEY_EAST") && names.includes("LLM_KEY_WEST"), `${command} reads both keys`);
      assert.ok(!names.some((name) => name.includes("*")), `${command}: the named keys, no pattern`);
    }
  }
  // Without deployments, the service's variables as before; OPENAI_API_KEY named by a deployment is among them.
  assert.deepEqual(envVariables(parseConfig({})), [...CONFIG_VARIABLES]);
  const openai = parseConfig(deploymentsEnv([deployment("east", { api_key_env: "OPENAI_API_KEY" })]));
  assert.deepEqual(envVariables(openai), [...CONFIG_VARIABLES]);
});
