/**
 * The read grants of the permission sets: the processes that validate
 * against tenants' schemas may read the validation Worker's modules, and
 * nothing more; the rest read nothing but the migrations where they migrate.
 */
import assert from "node:assert/strict";
import { parseConfig } from "../src/config.ts";
import { COMMANDS } from "../src/commands.ts";
import { permissionFlags, VALIDATION_WORKER, VALIDATION_WORKER_FILES } from "../src/permissions.ts";

const ROOT = decodeURIComponent(new URL("..", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../migrations/", import.meta.url).pathname);

Deno.test("api, worker and dev may read the validation Worker's modules; no other command reads them", () => {
  const config = parseConfig({});
  const reads = Object.fromEntries(COMMANDS.map((command) => {
    const flags = permissionFlags(command, config, MIGRATIONS).filter((flag) => flag.startsWith("--allow-read"));
    assert.ok(flags.length <= 1, `${command}: one --allow-read`);
    return [command, flags[0]?.slice("--allow-read=".length).split(",") ?? []];
  }));
  assert.deepEqual(reads, {
    api: VALIDATION_WORKER_FILES,
    worker: VALIDATION_WORKER_FILES,
    relay: [],
    dev: [MIGRATIONS, ...VALIDATION_WORKER_FILES],
    migrate: [MIGRATIONS],
    tenant: [],
    dlq: [],
    outbox: [],
    provider: [],
    tasks: [],
    usage: [],
  });
});

Deno.test("the validation Worker's read grant is exactly its module graph's local files", async () => {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["info", "--json", VALIDATION_WORKER],
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
    assert.ok(VALIDATION_WORKER_FILES.some((grant) => covers(grant, path)), `${path} is granted`);
  }
  for (const grant of VALIDATION_WORKER_FILES) {
    const inside = (await Deno.stat(grant)).isDirectory
      ? [...Deno.readDirSync(grant)].map((entry) => `${grant}/${entry.name}`)
      : [grant];
    for (const path of inside) assert.ok(local.includes(path), `${path} is granted but the Worker never loads it`);
  }
});
