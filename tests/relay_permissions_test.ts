/**
 * The relay may reach any host (webhook receivers cannot be known in
 * advance), but never Redis, by whatever spelling of its address, nor the
 * cloud metadata service; the same permission set still reaches Postgres and
 * an ordinary receiver on loopback. Each case runs a real Deno process with
 * the relay's flags and lets the runtime decide.
 */
import assert from "node:assert/strict";
import { launchFlags } from "../main.ts";
import { parseConfig } from "../src/config.ts";
import { permissionFlags, resolveProbeFlags, withRedisAddresses } from "../src/permissions.ts";
import { createTestDatabase, freePort, waitFor } from "./_support.ts";
import { startLocalCluster } from "./support/redis_cluster.ts";

const ROOT = decodeURIComponent(new URL("..", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../migrations/", import.meta.url).pathname);
const REDIS_PORT = 6379;
const POSTGRES_PORT = 5432;

/** One connection a probe process tries: a raw socket (Redis, Postgres) or an HTTP request. */
type Target =
  | { kind: "redis" | "postgres"; hostname: string; port: number }
  | { kind: "fetch"; url: string };

// Runs with the flags under test. Every outcome is "denied" (the runtime refused), "reached: <answer>", or
// "failed: <error>". Redis answers PING with +PONG; Postgres answers an SSLRequest with one byte (N or S).
const PROBE = `
const SSL_REQUEST = new Uint8Array([0, 0, 0, 8, 4, 210, 22, 47]);
const denied = (e) => e instanceof Deno.errors.NotCapable || /Requires net access/.test(String(e?.cause?.message));
async function attempt(t) {
  if (t.kind === "fetch") {
    const res = await fetch(t.url, { method: "POST", body: "{}" });
    return "reached: " + res.status + " " + (await res.text()).slice(0, 40);
  }
  const conn = await Deno.connect({ hostname: t.hostname, port: t.port });
  try {
    await conn.write(t.kind === "redis" ? new TextEncoder().encode("PING\\r\\n") : SSL_REQUEST);
    const buf = new Uint8Array(64);
    const n = await conn.read(buf);
    return "reached: " + JSON.stringify(new TextDecoder().decode(buf.subarray(0, n ?? 0)));
  } finally {
    conn.close();
  }
}
const out = [];
for (const t of JSON.parse(Deno.args[0])) {
  let timer;
  const timeout = new Promise((resolve) => (timer = setTimeout(() => resolve("failed: no answer in 3 s"), 3000)));
  const outcome = attempt(t).catch((e) => (denied(e) ? "denied" : "failed: " + e.name + " " + e.message + (e.cause ? " (" + e.cause.message + ")" : "")));
  out.push(await Promise.race([outcome, timeout]));
  clearTimeout(timer);
}
console.log(JSON.stringify(out));
Deno.exit(0);
`;

/** What a process run with `flags` gets for each target, in order. */
async function reach(flags: string[], targets: Target[]): Promise<string[]> {
  const probe = await Deno.makeTempFile({ suffix: ".js" });
  try {
    await Deno.writeTextFile(probe, PROBE);
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["run", "--no-config", ...flags, probe, JSON.stringify(targets)],
      stdout: "piped",
      stderr: "piped",
    }).output();
    const stderr = new TextDecoder().decode(out.stderr);
    assert.equal(out.code, 0, stderr);
    return JSON.parse(new TextDecoder().decode(out.stdout));
  } finally {
    await Deno.remove(probe);
  }
}

/** Redis on this machine at every spelling of a loopback address a webhook URL could carry. */
const REDIS_SPELLINGS: Target[] = [
  "127.0.0.1",
  "::1",
  "localhost",
  "::ffff:127.0.0.1",
  "0.0.0.0",
  "::",
  "127.0.0.2",
  "2130706433",
].map((hostname) => ({ kind: "redis", hostname, port: REDIS_PORT }));

/** Asserts every Redis spelling is denied, naming each one that was not and what it got. */
function assertRedisDenied(targets: Target[], outcomes: string[]): void {
  const leaks = targets.flatMap((t, i) => (outcomes[i] === "denied" ? [] : [`${JSON.stringify(t)} -> ${outcomes[i]}`]));
  assert.deepEqual(leaks, [], "Redis must be unreachable at every spelling");
}

/** A webhook receiver on loopback, on a port of its own. */
function startReceiver(hostname: string) {
  const server = Deno.serve({ hostname, port: 0, onListen: () => {} }, () => new Response("received"));
  const host = hostname.includes(":") ? `[${hostname}]` : hostname;
  return { url: `http://${host}:${server.addr.port}/hook`, close: () => server.shutdown() };
}

/** Postgres and two loopback receivers: what the relay must still reach. */
function allowedTargets(receivers: { url: string }[]): Target[] {
  return [
    { kind: "postgres", hostname: "127.0.0.1", port: POSTGRES_PORT },
    ...receivers.map(({ url }): Target => ({ kind: "fetch", url })),
  ];
}

function assertAllowedReached(outcomes: string[]): void {
  const [postgres, ...receivers] = outcomes;
  assert.match(postgres!, /^reached: "[NS]"$/, "Postgres answers the relay");
  for (const outcome of receivers) assert.equal(outcome, "reached: 200 received", "a loopback receiver answers");
}

Deno.test("the relay's set refuses Redis at every loopback spelling, and still reaches Postgres and receivers", async () => {
  const receivers = [startReceiver("127.0.0.1"), startReceiver("::1")];
  try {
    for (const allowPrivate of ["false", "true"]) {
      const config = parseConfig({
        REDIS_URL: `redis://127.0.0.1:${REDIS_PORT}/3`,
        DATABASE_URL: `postgres://postgres@127.0.0.1:${POSTGRES_PORT}/postgres`,
        WEBHOOK_ALLOW_PRIVATE: allowPrivate,
      });
      const flags = permissionFlags("relay", config, MIGRATIONS);
      const targets = [
        ...REDIS_SPELLINGS,
        { kind: "fetch", url: `http://[::1]:${REDIS_PORT}/` } as Target,
        ...allowedTargets(receivers),
      ];
      const outcomes = await reach(flags, targets);
      assertRedisDenied(targets.slice(0, REDIS_SPELLINGS.length + 1), outcomes);
      assertAllowedReached(outcomes.slice(REDIS_SPELLINGS.length + 1));
    }
  } finally {
    await Promise.all(receivers.map((r) => r.close()));
  }
});

Deno.test("the relay's set refuses the metadata service by address, whatever the spelling", async () => {
  const flags = permissionFlags("relay", parseConfig({}), MIGRATIONS);
  const targets: Target[] = ["169.254.169.254", "::ffff:169.254.169.254", "2852039166", "fd00:ec2:0:0:0:0:0:254"]
    .map((hostname) => ({ kind: "redis", hostname, port: 80 }));
  assert.deepEqual(await reach(flags, targets), targets.map(() => "denied"));
});

/** The relay's `--deny-net` entries, sorted. */
function deniedBy(flags: string[]): string[] {
  return (flags.find((f) => f.startsWith("--deny-net="))?.slice("--deny-net=".length).split(",") ?? []).sort();
}

/** Redis at `hostnames`, on `port`. */
const redisAt = (hostnames: string[], port = REDIS_PORT): Target[] =>
  hostnames.map((hostname) => ({ kind: "redis", hostname, port }));

Deno.test("Redis named by a host name, as compose names it: the launcher denies every address it resolves to", async () => {
  const receivers = [startReceiver("127.0.0.1"), startReceiver("::1")];
  try {
    // `localhost` is a name that every machine resolves. `2130706433` is no IP literal to the URL parser
    // (redis: URLs keep their host as written), so only the launcher's look-up learns it is 127.0.0.1.
    for (const name of ["localhost", "2130706433"]) {
      // What `deno task relay` derives (main.ts launchFlags, probes included) when REDIS_URL has a name.
      const flags = await launchFlags(
        "relay",
        parseConfig({ REDIS_URL: `redis://${name}:${REDIS_PORT}`, WEBHOOK_ALLOW_PRIVATE: "true" }),
      );
      const named = redisAt([name, "localhost", "127.0.0.1", "::1", "::ffff:127.0.0.1", "0.0.0.0"]);
      const outcomes = await reach(flags, [...named, ...allowedTargets(receivers)]);
      assertRedisDenied(named, outcomes);
      assertAllowedReached(outcomes.slice(named.length));
    }
  } finally {
    await Promise.all(receivers.map((r) => r.close()));
  }
});

Deno.test("the launcher looks a Redis host name up as the Redis client would, and denies each address found", async () => {
  // The probe the launcher runs (`main.ts resolve-hosts`), allowed to look up just these names.
  const names = ["localhost", "oncely-no-such-host.invalid"];
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", ...resolveProbeFlags(names), "main.ts", "resolve-hosts", ...names],
    cwd: ROOT,
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
  const found = JSON.parse(new TextDecoder().decode(out.stdout));
  assert.ok(found.localhost.includes("127.0.0.1"), JSON.stringify(found));
  assert.deepEqual(found["oncely-no-such-host.invalid"], []);

  // Compose's `redis` resolves to the container's addresses: each is denied on Redis's port, besides the name.
  const compose = parseConfig({ REDIS_URL: "redis://redis:6379" });
  const resolved = withRedisAddresses(compose, { redis: ["172.18.0.2", "fd00:0:0:0:0:0:0:2", "fe80::1%eth0", "x"] });
  assert.deepEqual(
    deniedBy(permissionFlags("relay", resolved, MIGRATIONS)),
    [
      "169.254.169.254",
      "172.18.0.2:6379",
      "[fd00::2]:6379",
      "[fd00:ec2::254]",
      "metadata.google.internal",
      "redis:6379",
    ]
      .sort(),
  );
  // A name that resolves to this machine is denied at every spelling of this machine, as the runtime shows.
  const local = withRedisAddresses(parseConfig({ REDIS_URL: `redis://cache.internal:${REDIS_PORT}` }), {
    "cache.internal": ["127.0.0.1"],
  });
  const targets = redisAt(["127.0.0.1", "::1", "localhost", "::"]);
  assertRedisDenied(targets, await reach(permissionFlags("relay", local, MIGRATIONS), targets));
});

Deno.test("every node of a Redis Cluster is denied to the relay, not only the seed REDIS_URL names", async () => {
  const cluster = await startLocalCluster();
  try {
    const flags = await launchFlags("relay", parseConfig({ REDIS_URL: cluster.nodes[0]! }));
    const targets = cluster.nodes.flatMap((node) => redisAt(["127.0.0.1", "::1"], Number(new URL(node).port)));
    assertRedisDenied(targets, await reach(flags, targets));
  } finally {
    await cluster.stop();
  }
});

Deno.test("`deno task relay` starts and serves on the set it derives for a named Redis", async () => {
  const db = await createTestDatabase();
  const metricsPort = freePort();
  const task = new Deno.Command(Deno.execPath(), {
    args: ["task", "relay"],
    cwd: ROOT,
    env: {
      REDIS_URL: `redis://localhost:${REDIS_PORT}`,
      DATABASE_URL: db.url,
      METRICS_PORT: String(metricsPort),
      NO_COLOR: "1",
    },
    stdout: "null",
    stderr: "piped",
  }).spawn();
  try {
    // Its own Postgres, its listener and its start-up check all pass under the widened --deny-net.
    await waitFor(
      "the relay's /healthz",
      () => fetch(`http://127.0.0.1:${metricsPort}/healthz`).then((r) => (r.body?.cancel(), r.ok), () => false),
      20_000,
    );
  } finally {
    task.kill("SIGTERM");
    const status = await task.status;
    const stderr = await new Response(task.stderr).text();
    await db.close();
    assert.equal(status.code, 0, stderr.slice(-1000));
    assert.doesNotMatch(stderr, /redis_denied_by_name_only|Cannot start/);
  }
});
