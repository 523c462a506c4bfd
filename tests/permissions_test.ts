/**
 * The read grants of the permission sets: the processes that validate
 * against tenants' schemas may read the validation Worker's and the
 * definition check Worker's modules, and nothing more; the rest read nothing but the migrations where they migrate.
 * And the network grants for Redis behind Sentinel.
 */
import assert from "node:assert/strict";
import { parseConfig, parseSentinelUrl } from "../src/config.ts";
import { COMMANDS } from "../src/commands.ts";
import {
  DEFINITION_WORKER,
  DEFINITION_WORKER_FILES,
  permissionFlags,
  redisHostNames,
  redisProbeFlags,
  VALIDATION_WORKER,
  VALIDATION_WORKER_FILES,
  withRedisAddresses,
  withRedisHosts,
  WORKER_FILES,
} from "../src/permissions.ts";

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
