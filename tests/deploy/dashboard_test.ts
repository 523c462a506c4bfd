/**
 * The Grafana dashboard (deploy/grafana/), the alert rules and KEDA's query against live processes: every PromQL
 * expression parses (promtool, as recording rules in a temporary file), and every metric it names is on the
 * `/metrics` of a real api, worker or relay started as `deno task` starts them (with METRICS_TOKEN, so through
 * the bearer token). Those pages are clean under `promtool check metrics` and carry the process metrics. Then
 * Debian's Prometheus, with deploy/prometheus/'s scrape configuration and rules pointed at the processes, scrapes
 * all three and evaluates the rules: the monitoring profile of compose.yaml without Docker (Grafana is not
 * packaged for Debian: its dashboard's queries are checked here instead).
 */
import assert from "node:assert/strict";
import { parse, stringify } from "npm:yaml@2.8.1";
import { createTestDatabase, freePort, REDIS_URL, waitFor } from "../_support.ts";
import { emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { deployment, deploymentsEnv } from "../support/deployments_env.ts";
import { promtool, promtoolMissing } from "../support/promtool.ts";

const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);
const tasks = JSON.parse(await Deno.readTextFile(`${ROOT}deno.json`)).tasks as Record<string, string>;
const dashboard = JSON.parse(await Deno.readTextFile(`${ROOT}deploy/grafana/dashboards/oncely.json`));
const missing = await promtoolMissing();
const prometheus = await new Deno.Command("prometheus", { args: ["--version"], stdout: "null", stderr: "null" })
  .output().then((o) => o.success, () => false);
const TOKEN = "dashboard-test-metrics-token";
const CONCURRENCY = 4;

/** Every PromQL expression of the dashboard's panels, with the panel's title. */
function dashboardQueries(): { title: string; expr: string }[] {
  const out: { title: string; expr: string }[] = [];
  for (const panel of dashboard.panels as { title: string; targets?: { expr: string }[] }[]) {
    for (const target of panel.targets ?? []) out.push({ title: panel.title, expr: target.expr });
  }
  return out;
}

const KEYWORDS = new Set([
  "by",
  "without",
  "on",
  "ignoring",
  "group_left",
  "group_right",
  "offset",
  "bool",
  "and",
  "or",
  "unless",
]);

/** The metric names a PromQL expression reads: what is left once strings, label sets, ranges, groupings and calls go. */
export function metricNames(expr: string): string[] {
  const bare = expr
    .replace(/"(?:[^"\\]|\\.)*"/g, '""')
    .replace(/\{[^}]*\}/g, " ")
    .replace(/\[[^\]]*\]/g, " ")
    .replace(/\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)/g, " ");
  const names = new Set<string>();
  for (const m of bare.matchAll(/([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?/g)) {
    if (m[2] || KEYWORDS.has(m[1]!) || /^(inf|nan)$/i.test(m[1]!)) continue;
    if (/\d$/.test(bare.slice(0, m.index))) continue; // a duration's unit (5m) or an exponent
    names.add(m[1]!);
  }
  return [...names];
}

/** The metric names a Prometheus exposition declares (`# TYPE`), with a histogram's series names. */
function exportedNames(text: string): Set<string> {
  const names = new Set<string>();
  for (const m of text.matchAll(/^# TYPE (\S+) (\S+)$/gm)) {
    names.add(m[1]!);
    if (m[2] === "histogram") { for (const s of ["_bucket", "_sum", "_count"]) names.add(m[1]! + s); }
    if (m[2] === "summary") { for (const s of ["_sum", "_count"]) names.add(m[1]! + s); }
  }
  return names;
}

/** A sample's value: `name` exactly (no labels). */
function sample(text: string, name: string): number | undefined {
  const m = new RegExp(`^${name} (\\S+)$`, "m").exec(text);
  return m ? Number(m[1]) : undefined;
}

Deno.test("metricNames finds the metrics of an expression and nothing else", () => {
  assert.deepEqual(
    metricNames(
      'histogram_quantile(0.99, sum by (le, route) (rate(oncely_http_request_duration_seconds_bucket{a="b(c)"}[5m])))',
    ),
    ["oncely_http_request_duration_seconds_bucket"],
  );
  assert.deepEqual(metricNames("max(a_total) + (sum(b) or vector(0)) > 1e3 and c offset 1h").sort(), [
    "a_total",
    "b",
    "c",
  ]);
});

Deno.test({
  name: "dashboard, alerts and KEDA: every query parses and names only metrics a live api, worker or relay exports",
  ignore: missing !== undefined,
  sanitizeResources: false, // the fake model server's connections
  async fn(t) {
    const queries = dashboardQueries();
    assert.ok(queries.length >= 25, `${queries.length} queries`);

    await t.step("every dashboard query parses (promtool check rules)", async () => {
      const dir = await Deno.makeTempDir({ prefix: "oncely-dashboard-" });
      try {
        const rules = {
          groups: [{
            name: "dashboard",
            rules: queries.map((q, i) => ({ record: `dashboard:panel_${i}`, expr: q.expr })),
          }],
        };
        await Deno.writeTextFile(`${dir}/dashboard.yml`, stringify(rules));
        const { code, out } = await promtool(["check", "rules", `${dir}/dashboard.yml`]);
        assert.equal(code, 0, out);
        assert.match(out, new RegExp(`SUCCESS: ${queries.length} rules found`));
        // And the check has teeth.
        await Deno.writeTextFile(
          `${dir}/bad.yml`,
          stringify({ groups: [{ name: "x", rules: [{ record: "x:y", expr: "sum(rate(x[5m])" }] }] }),
        );
        assert.notEqual((await promtool(["check", "rules", `${dir}/bad.yml`])).code, 0);
      } finally {
        await Deno.remove(dir, { recursive: true });
      }
    });

    const db = await createTestDatabase();
    const redisUrl = await emptyRedisDatabase(REDIS_URL);
    const model = startFakeModel();
    const [apiPort, workerPort, relayPort] = [freePort(), freePort(), freePort()];
    const env = {
      DATABASE_URL: db.url,
      REDIS_URL: redisUrl,
      HOST: "127.0.0.1",
      LOG_LEVEL: "warn",
      NO_COLOR: "1",
      METRICS_TOKEN: TOKEN,
      // The OpenAI provider, so the worker exports the breaker's state (the extractive one has none).
      OPENAI_API_KEY: "sk-test",
      OPENAI_BASE_URL: model.url,
      WORKER_CONCURRENCY: String(CONCURRENCY),
    };
    const spawn = (name: string, extra: Record<string, string>) =>
      new Deno.Command(Deno.execPath(), {
        args: tasks[name]!.split(/\s+/).slice(1),
        env: { ...env, ...extra },
        cwd: ROOT,
        stdout: "null",
        stderr: "piped",
      }).spawn();
    const processes = {
      api: { child: spawn("api", { PORT: String(apiPort) }), url: `http://127.0.0.1:${apiPort}` },
      // A deployment with the Batch API, so the worker exports the batch metrics (issue 43) too.
      worker: {
        child: spawn("worker", {
          METRICS_PORT: String(workerPort),
          ...deploymentsEnv([deployment("main", { base_url: model.url, batch: true })]),
        }),
        url: `http://127.0.0.1:${workerPort}`,
      },
      relay: { child: spawn("relay", { METRICS_PORT: String(relayPort) }), url: `http://127.0.0.1:${relayPort}` },
    };
    const pages: Record<string, string> = {};
    try {
      for (const [name, { url }] of Object.entries(processes)) {
        await waitFor(
          `the ${name}`,
          () => fetch(`${url}/readyz`).then((r) => (r.body?.cancel(), r.ok), () => false),
          30_000,
        );
      }

      await t.step(
        "each process answers /metrics with the token only, promtool-clean, with process metrics",
        async () => {
          for (const [name, { url }] of Object.entries(processes)) {
            const refused = await fetch(`${url}/metrics`);
            await refused.body?.cancel();
            assert.equal(refused.status, 401, `${name} without the token`);
            // The backlog's first walk runs at start; its snapshot is read on scrape.
            const text = await waitFor(`${name}'s metrics`, async () => {
              const res = await fetch(`${url}/metrics`, { headers: { authorization: `Bearer ${TOKEN}` } });
              const body = await res.text();
              return res.ok && (name === "relay" || /^oncely_queue_snapshot_age_seconds \d/m.test(body)) ? body : null;
            }, 15_000);
            pages[name] = text;
            const check = await promtool(["check", "metrics"], text);
            assert.equal(check.code, 0, `${name}: ${check.out}`);
            assert.equal(check.out.trim(), "", `${name}: ${check.out}`);
            assert.ok(sample(text, "process_cpu_seconds_total")! > 0, `${name} CPU`);
            assert.ok(sample(text, "process_resident_memory_bytes")! > 10_000_000, `${name} resident memory`);
            assert.ok(sample(text, "nodejs_heap_size_used_bytes")! > 1_000_000, `${name} heap`);
            assert.ok(sample(text, "nodejs_eventloop_lag_p99_seconds")! >= 0, `${name} event-loop lag`);
            assert.ok(sample(text, "process_start_time_seconds")! > 1_600_000_000, `${name} start time`);
            assert.equal(
              sample(text, "process_open_fds"),
              undefined,
              `${name}: no false 0 where /proc is not readable`,
            );
          }
          assert.equal(sample(pages.worker!, "oncely_worker_free_slots"), CONCURRENCY);
          // Its batch deployment's series, from 0 (no batch in flight).
          assert.match(pages.worker!, /^oncely_batch_oldest_in_flight_seconds\{deployment="main"\} 0$/m);
          assert.match(pages.worker!, /^oncely_batches_in_flight\{state="submitted",deployment="main"\} 0$/m);
          for (const name of ["api", "worker"]) {
            assert.equal(sample(pages[name]!, "oncely_queue_waiting"), 0, `${name} exports the summed backlog`);
            assert.equal(sample(pages[name]!, "oncely_queue_oldest_waiting_seconds"), 0);
          }
        },
      );

      await t.step("every metric the dashboard, the alerts and KEDA name is exported by a live process", async () => {
        const exported = new Set(Object.values(pages).flatMap((text) => [...exportedNames(text)]));
        // `up` is Prometheus's own, per scraped target.
        const known = (name: string) => name === "up" || exported.has(name);
        for (const { title, expr } of queries) {
          for (const name of metricNames(expr)) assert.ok(known(name), `panel "${title}": ${name} is exported`);
        }
        const alerts = parse(await Deno.readTextFile(`${ROOT}deploy/prometheus/alerts.yml`));
        for (const rule of alerts.groups[0].rules as { alert: string; expr: string }[]) {
          for (const name of metricNames(rule.expr)) assert.ok(known(name), `alert ${rule.alert}: ${name} is exported`);
        }
        const keda = parse(await Deno.readTextFile(`${ROOT}deploy/kubernetes/keda.yaml`));
        const query = keda.spec.triggers[0].metadata.query as string;
        for (const name of metricNames(query)) assert.ok(known(name), `KEDA's query: ${name} is exported`);
        const { code, out } = await promtool(["check", "rules"], undefined).then(async () => {
          const dir = await Deno.makeTempDir();
          await Deno.writeTextFile(
            `${dir}/keda.yml`,
            stringify({ groups: [{ name: "keda", rules: [{ record: "keda:query", expr: query }] }] }),
          );
          try {
            return await promtool(["check", "rules", `${dir}/keda.yml`]);
          } finally {
            await Deno.remove(dir, { recursive: true });
          }
        });
        assert.equal(code, 0, out);
      });

      await t.step({
        name: "Prometheus scrapes the three with deploy/prometheus/'s configuration and evaluates the alert rules",
        ignore: !prometheus,
        fn: async () => {
          const dir = await Deno.makeTempDir({ prefix: "oncely-prometheus-" });
          const port = freePort();
          const config = parse(await Deno.readTextFile(`${ROOT}deploy/prometheus/prometheus.yml`));
          config.global.scrape_interval = "1s";
          config.global.evaluation_interval = "1s";
          const targets: Record<string, number> = {
            "oncely-api": apiPort,
            "oncely-worker": workerPort,
            "oncely-relay": relayPort,
          };
          for (const job of config.scrape_configs) {
            // Compose's service names become this machine's ports; everything else is the shipped file's.
            delete job.dns_sd_configs;
            job.static_configs = [{ targets: [`127.0.0.1:${targets[job.job_name]}`] }];
            job.authorization.credentials_file = `${dir}/metrics_token`;
          }
          config.rule_files = [`${ROOT}deploy/prometheus/alerts.yml`];
          await Deno.writeTextFile(`${dir}/metrics_token`, TOKEN);
          await Deno.writeTextFile(`${dir}/prometheus.yml`, stringify(config));
          const server = new Deno.Command("prometheus", {
            args: [
              `--config.file=${dir}/prometheus.yml`,
              `--storage.tsdb.path=${dir}/data`,
              `--web.listen-address=127.0.0.1:${port}`,
            ],
            stdout: "null",
            stderr: "null",
          }).spawn();
          const query = async (q: string) => {
            const res = await fetch(`http://127.0.0.1:${port}/api/v1/query?query=${encodeURIComponent(q)}`);
            return res.ok
              ? (await res.json()).data.result as { metric: Record<string, string>; value: [number, string] }[]
              : [];
          };
          try {
            const up = await waitFor("three targets up", async () => {
              const result = await query("up == 1").catch(() => []);
              return result.length === 3 ? result : null;
            }, 30_000);
            assert.deepEqual(up.map((r) => r.metric.job).sort(), ["oncely-api", "oncely-relay", "oncely-worker"]);
            const waiting = await waitFor(
              "the backlog",
              () => query("max(oncely_queue_waiting)").catch(() => []).then((r) => r.length ? r : null),
              10_000,
            );
            assert.equal(waiting[0]!.value[1], "0");
            const rules = await waitFor("the rules evaluated", async () => {
              const res = await fetch(`http://127.0.0.1:${port}/api/v1/rules`).catch(() => undefined);
              const groups = res?.ok
                ? (await res.json()).data.groups as {
                  rules: { name: string; health: string; lastEvaluation: string }[];
                }[]
                : [];
              const all = groups.flatMap((g) => g.rules);
              return all.length === 9 && all.every((r) => !r.lastEvaluation.startsWith("0001")) ? all : null;
            }, 15_000);
            for (const rule of rules) assert.equal(rule.health, "ok", rule.name);
            // With all three up and nothing queued, no alert fires.
            const firing = await query('ALERTS{alertstate="firing"}');
            assert.deepEqual(firing, []);
          } finally {
            server.kill("SIGTERM");
            await server.status;
            await Deno.remove(dir, { recursive: true });
          }
        },
      });
    } finally {
      for (const [name, { child }] of Object.entries(processes)) {
        child.kill("SIGTERM");
        const [status, err] = await Promise.all([child.status, new Response(child.stderr).text()]);
        assert.equal(status.code, 0, `${name}: ${err.slice(-800)}`);
      }
      await model.close();
      await releaseRedisDatabase(redisUrl);
      await db.close();
    }
  },
});

/** Whether `docker` runs, with its compose plugin and a reachable engine: decided before the tests, so the
 * monitoring profile's test is reported as ignored (not passed) where they are missing. */
async function dockerCompose(): Promise<boolean> {
  const ok = (args: string[]) =>
    new Deno.Command("docker", { args, stdout: "null", stderr: "null" }).output().then((o) => o.success, () => false);
  return await ok(["compose", "version"]) && await ok(["info"]);
}
const docker = await dockerCompose();

Deno.test({
  // Ignored where Docker or its compose plugin is missing (compose_test.ts checks the profile statically).
  name: "compose.yaml's monitoring profile starts Prometheus and Grafana (needs Docker with compose)",
  ignore: !docker,
  async fn() {
    const run = (args: string[]) =>
      new Deno.Command("docker", {
        args: ["compose", "--profile", "monitoring", ...args],
        cwd: ROOT,
        env: { METRICS_TOKEN: TOKEN },
      })
        .output();
    try {
      assert.ok((await run(["up", "-d", "--wait"])).success);
      const ready = await fetch("http://127.0.0.1:9090/-/ready");
      await ready.body?.cancel();
      assert.ok(ready.ok);
      const health = await fetch("http://127.0.0.1:3000/api/health");
      await health.body?.cancel();
      assert.ok(health.ok);
    } finally {
      await run(["down", "-v"]);
    }
  },
});
