import assert from "node:assert/strict";
import { ConfigError, deploymentKeyVariables, parseConfig } from "../src/config.ts";
import { deployment, deploymentsEnv, keyOf } from "./support/deployments_env.ts";

Deno.test("parseConfig() applies the contract's defaults", () => {
  const c = parseConfig({});
  assert.equal(c.REDIS_URL, "redis://127.0.0.1:6379");
  assert.equal(c.DATABASE_URL, "postgres://postgres@127.0.0.1:5432/postgres");
  assert.equal(c.HOST, "127.0.0.1");
  assert.equal(c.PORT, 8000);
  assert.equal(c.AUTH_MODE, "api-key");
  assert.equal(c.LLM_PROVIDER, "extractive");
  assert.equal(c.OPENAI_MODEL, "gpt-4.1-mini");
  assert.equal(c.MAIL_PROVIDER, "log");
  assert.equal(c.RESEND_BASE_URL, "https://api.resend.com");
  assert.equal(c.MAIL_FROM, "summaries@localhost");
  assert.deepEqual(
    [c.IDEMPOTENCY_LOCK_TTL_S, c.IDEMPOTENCY_RESULT_TTL_S, c.CLAIM_IDLE_MS, c.MAX_DELIVERIES, c.WORKER_CONCURRENCY],
    [30, 86400, 120000, 5, 32],
  );
  assert.deepEqual([c.JOB_BUDGET_S, c.LLM_CALL_TIMEOUT_S, c.LLM_MAX_ATTEMPTS], [60, 20, 4]);
  assert.deepEqual([c.RELAY_BATCH, c.RELAY_MAX_ATTEMPTS, c.MAIL_SEND_TIMEOUT_S], [20, 10, 10]);
  assert.equal(c.MAX_BODY_BYTES, 1048576);
  assert.equal(c.LOG_LEVEL, "info");
  assert.equal(c.METRICS_PORT, undefined);
  assert.equal(c.LLM_DEPLOYMENTS, undefined);
  assert.equal(c.LLM_FALLBACK_AFTER_S, 10);
});

Deno.test("parseConfig() picks openai and resend when their keys are set", () => {
  const c = parseConfig({ OPENAI_API_KEY: "sk-x", RESEND_API_KEY: "re_x" });
  assert.equal(c.LLM_PROVIDER, "openai");
  assert.equal(c.MAIL_PROVIDER, "resend");
});

Deno.test("parseConfig() names the variable and the value it rejects", () => {
  const cases: [Record<string, string>, string, RegExp][] = [
    [{ REDIS_URL: "localhost" }, "REDIS_URL", /REDIS_URL is not a redis:\/\/ or rediss:\/\/ URL.*\(got "localhost"\)/],
    [{ PORT: "eighty" }, "PORT", /PORT must be a whole number \(got "eighty"\)/],
    [{ PORT: "70000" }, "PORT", /PORT must be at most 65535/],
    [{ CLAIM_IDLE_MS: "-1" }, "CLAIM_IDLE_MS", /CLAIM_IDLE_MS/],
    [{ AUTH_MODE: "none" }, "AUTH_MODE", /AUTH_MODE must be api-key or trusted-header/],
    [{ LOG_LEVEL: "loud" }, "LOG_LEVEL", /LOG_LEVEL/],
    [{ JOB_BUDGET_S: "0" }, "JOB_BUDGET_S", /JOB_BUDGET_S must be greater than 0/],
    [{ LLM_PROVIDER: "openai" }, "OPENAI_API_KEY", /OPENAI_API_KEY must be set when LLM_PROVIDER=openai/],
    [{ MAIL_PROVIDER: "resend" }, "RESEND_API_KEY", /RESEND_API_KEY must be set/],
  ];
  for (const [env, variable, message] of cases) {
    assert.throws(() => parseConfig(env), (e: unknown) => {
      assert.ok(e instanceof ConfigError);
      assert.equal(e.variable, variable);
      assert.match(e.message, message);
      assert.ok(!e.message.includes("\n"), "one line");
      return true;
    });
  }
});

Deno.test("parseConfig() never echoes a URL that may carry a password", () => {
  assert.throws(() => parseConfig({ DATABASE_URL: "mysql://u:secret@db/x" }), (e: Error) => {
    assert.doesNotMatch(e.message, /secret/);
    return true;
  });
});

Deno.test("main.ts exits 2 with one line naming the variable on a bad value", async () => {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "--allow-env", "--allow-read", "--allow-net", "--allow-sys", "main.ts", "api"],
    env: { PORT: "not-a-port" },
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.equal(out.code, 2);
  const stderr = new TextDecoder().decode(out.stderr).trim();
  assert.equal(stderr.split("\n").length, 1, stderr);
  assert.match(stderr, /^Cannot start: PORT must be a whole number \(got "not-a-port"\)$/);
});

Deno.test("main.ts says which dependency is down, where, and how to start it", async () => {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "--allow-env", "--allow-read", "--allow-net", "--allow-sys", "main.ts", "tenant", "list"],
    env: { DATABASE_URL: "postgres://postgres@127.0.0.1:1/postgres" },
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.equal(out.code, 1);
  const stderr = new TextDecoder().decode(out.stderr);
  assert.match(stderr, /Postgres at postgres:\/\/postgres@127\.0\.0\.1:1\/postgres \(DATABASE_URL\) does not answer/);
  assert.match(stderr, /docker compose up -d postgres/);
});

Deno.test("deno task dev names a Redis that does not answer, its URL, and how to start it", async () => {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["task", "dev"],
    env: { REDIS_URL: "redis://127.0.0.1:1/0", NO_COLOR: "1" },
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.equal(out.code, 1);
  const stderr = new TextDecoder().decode(out.stderr);
  assert.match(stderr, /Cannot start: Redis at redis:\/\/127\.0\.0\.1:1\/0 \(REDIS_URL\) does not answer/);
  assert.match(stderr, /docker compose up -d redis/);
});

Deno.test("a Sentinel REDIS_URL: a bad one stops start-up naming the problem, unanswering sentinels are named", async () => {
  const run = (REDIS_URL: string) =>
    new Deno.Command(Deno.execPath(), {
      args: ["task", "provider", "status"],
      env: { REDIS_URL, NO_COLOR: "1" },
      stdout: "piped",
      stderr: "piped",
    }).output();
  const bad = await run("redis+sentinel://127.0.0.1:1");
  assert.equal(bad.code, 2);
  assert.match(new TextDecoder().decode(bad.stderr), /Cannot start: REDIS_URL names no SERVICE/);
  const down = await run("redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster/0");
  assert.equal(down.code, 1);
  const stderr = new TextDecoder().decode(down.stderr);
  assert.match(
    stderr,
    /Cannot start: no sentinel of redis\+sentinel:\/\/127\.0\.0\.1:1,127\.0\.0\.1:2\/mymaster \(REDIS_URL\)/,
  );
  assert.match(stderr, /last sentinel error: failed to connect to sentinel 127\.0\.0\.1:\d because/);
});

Deno.test("parseConfig() refuses trusted-header mode without GATEWAY_SECRET, and never echoes the secret", () => {
  assert.throws(() => parseConfig({ AUTH_MODE: "trusted-header" }), /requires GATEWAY_SECRET/);
  assert.equal(
    parseConfig({ AUTH_MODE: "trusted-header", GATEWAY_SECRET: "s".repeat(20) }).AUTH_MODE,
    "trusted-header",
  );
  assert.throws(
    () => parseConfig({ AUTH_MODE: "trusted-header", GATEWAY_SECRET: "short-secret" }),
    (e: Error) => /GATEWAY_SECRET must be at least 16/.test(e.message) && !e.message.includes("short-secret"),
  );
});

Deno.test("parseConfig() keeps summaries at least as long as keys replay", () => {
  assert.throws(
    () => parseConfig({ SUMMARY_RETENTION_S: "3600", IDEMPOTENCY_RESULT_TTL_S: "86400" }),
    /SUMMARY_RETENTION_S must be at least IDEMPOTENCY_RESULT_TTL_S/,
  );
  assert.equal(parseConfig({ SUMMARY_RETENTION_S: "2592000" }).SUMMARY_RETENTION_S, 2592000);
});

Deno.test("parseConfig() refuses MAIL_TENANT_HOURLY_LIMIT when OUTBOX_RETENTION_S is under an hour, naming both", () => {
  assert.throws(
    () => parseConfig({ MAIL_TENANT_HOURLY_LIMIT: "100", OUTBOX_RETENTION_S: "1800" }),
    (e: unknown) => {
      assert.ok(e instanceof ConfigError);
      assert.equal(e.variable, "OUTBOX_RETENTION_S");
      assert.match(e.message, /^Cannot start: .*MAIL_TENANT_HOURLY_LIMIT/);
      assert.match(e.message, /OUTBOX_RETENTION_S must be at least 3600/);
      assert.match(e.message, /\(got 1800\)/);
      assert.ok(!e.message.includes("\n"), "one line");
      return true;
    },
  );
  // Either alone is fine, and so is an hour's retention with the cap.
  assert.equal(parseConfig({ OUTBOX_RETENTION_S: "1800" }).OUTBOX_RETENTION_S, 1800);
  assert.equal(parseConfig({ MAIL_TENANT_HOURLY_LIMIT: "100" }).MAIL_TENANT_HOURLY_LIMIT, 100);
  const both = parseConfig({ MAIL_TENANT_HOURLY_LIMIT: "100", OUTBOX_RETENTION_S: "3600" });
  assert.deepEqual([both.MAIL_TENANT_HOURLY_LIMIT, both.OUTBOX_RETENTION_S], [100, 3600]);
});

Deno.test("main.ts refuses MAIL_TENANT_HOURLY_LIMIT with OUTBOX_RETENTION_S under an hour, in one line", async () => {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "--allow-env", "--allow-read", "--allow-net", "--allow-sys", "main.ts", "relay"],
    // Servers nobody answers on: were the configuration accepted, the relay would exit 1 without touching any data.
    env: {
      MAIL_TENANT_HOURLY_LIMIT: "100",
      OUTBOX_RETENTION_S: "600",
      REDIS_URL: "redis://127.0.0.1:1/0",
      DATABASE_URL: "postgres://postgres@127.0.0.1:1/postgres",
    },
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.equal(out.code, 2);
  const stderr = new TextDecoder().decode(out.stderr).trim();
  assert.equal(stderr.split("\n").length, 1, stderr);
  assert.match(
    stderr,
    /^Cannot start: MAIL_TENANT_HOURLY_LIMIT .* OUTBOX_RETENTION_S must be at least 3600 .*\(got 600\)$/,
  );
});

Deno.test("parseConfig() refuses WEBHOOK_TENANT_HOURLY_LIMIT when OUTBOX_RETENTION_S is under an hour, naming both", () => {
  assert.throws(
    () => parseConfig({ WEBHOOK_TENANT_HOURLY_LIMIT: "50", OUTBOX_RETENTION_S: "1800" }),
    (e: unknown) => {
      assert.ok(e instanceof Error);
      assert.match(e.message, /^Cannot start: WEBHOOK_TENANT_HOURLY_LIMIT .* OUTBOX_RETENTION_S must be at least 3600/);
      return true;
    },
  );
  assert.equal(parseConfig({ WEBHOOK_TENANT_HOURLY_LIMIT: "50" }).WEBHOOK_TENANT_HOURLY_LIMIT, 50);
});

Deno.test("LLM_DEPLOYMENTS: each deployment with its defaults and its key, read from the variable it names", () => {
  const c = parseConfig(deploymentsEnv([
    deployment("east", { weight: 3, rpm: 900, tpm: 90_000, batch: true }),
    deployment("west", { models: ["gpt-4.1-mini", "gpt-4.1"], api_key_env: "OPENAI_API_KEY" }),
  ], { LLM_FALLBACK_AFTER_S: "2.5" }));
  assert.equal(c.LLM_PROVIDER, "openai", "LLM_DEPLOYMENTS alone picks openai");
  assert.equal(c.LLM_FALLBACK_AFTER_S, 2.5);
  assert.deepEqual(c.LLM_DEPLOYMENTS, [
    {
      name: "east",
      base_url: "https://east.example.com/v1",
      api_key_env: "LLM_KEY_EAST",
      api_key: keyOf("LLM_KEY_EAST"),
      models: ["gpt-4.1-mini"],
      weight: 3,
      rpm: 900,
      tpm: 90_000,
      batch: true,
    },
    {
      name: "west",
      base_url: "https://west.example.com/v1",
      api_key_env: "OPENAI_API_KEY",
      api_key: keyOf("OPENAI_API_KEY"),
      models: ["gpt-4.1-mini", "gpt-4.1"],
      weight: 1,
      batch: false,
    },
  ]);
  // OPENAI_API_KEY is not needed when no deployment names it, and LLM_PROVIDER=openai may still be said.
  const named = parseConfig(deploymentsEnv([deployment("east")], { LLM_PROVIDER: "openai" }));
  assert.equal(named.OPENAI_API_KEY, undefined);
  assert.equal(named.LLM_DEPLOYMENTS![0]!.api_key, keyOf("LLM_KEY_EAST"));
  assert.equal(parseConfig({ LLM_FALLBACK_AFTER_S: "0" }).LLM_FALLBACK_AFTER_S, 0);
});

Deno.test("LLM_DEPLOYMENTS: each mistake is one line naming the deployment and the field, never a key", () => {
  const east = deployment("east");
  const cases: [Record<string, string>, string, RegExp][] = [
    [{ LLM_DEPLOYMENTS: "[{" }, "LLM_DEPLOYMENTS", /^Cannot start: LLM_DEPLOYMENTS is not JSON; for example \[/],
    [{ LLM_DEPLOYMENTS: '{"name": "east"}' }, "LLM_DEPLOYMENTS", /LLM_DEPLOYMENTS must be a JSON array of deployments/],
    [{ LLM_DEPLOYMENTS: "[]" }, "LLM_DEPLOYMENTS", /LLM_DEPLOYMENTS must list at least one deployment/],
    [deploymentsEnv([east, "west"]), "LLM_DEPLOYMENTS", /LLM_DEPLOYMENTS\[1\] must be an object/],
    [
      deploymentsEnv([east, { ...east }]),
      "LLM_DEPLOYMENTS",
      /LLM_DEPLOYMENTS\[1\] has the name "east" of LLM_DEPLOYMENTS\[0\]/,
    ],
    [deploymentsEnv([{ ...east, name: undefined }]), "LLM_DEPLOYMENTS", /LLM_DEPLOYMENTS\[0\]\.name is missing/],
    [deploymentsEnv([{ ...east, name: "east coast" }]), "LLM_DEPLOYMENTS", /\[0\]\.name must be 1 to 64 letters/],
    [deploymentsEnv([{ ...east, name: "x".repeat(65) }]), "LLM_DEPLOYMENTS", /\[0\]\.name must be 1 to 64/],
    [
      deploymentsEnv([{ ...east, base_url: "ftp://east.example.com" }]),
      "LLM_DEPLOYMENTS",
      /LLM_DEPLOYMENTS\[0\] \("east"\)\.base_url is not an http:\/\/ or https:\/\/ URL/,
    ],
    [deploymentsEnv([{ ...east, base_url: "east.example.com" }]), "LLM_DEPLOYMENTS", /\("east"\)\.base_url is not/],
    [
      deploymentsEnv([{ ...east, base_url: "https://u:sk-test-pw@east.example.com/v1" }]),
      "LLM_DEPLOYMENTS",
      /\("east"\)\.base_url must carry no user name or password/,
    ],
    [
      deploymentsEnv([{ ...east, api_key_env: "EAST_KEY" }]),
      "LLM_DEPLOYMENTS",
      /\("east"\)\.api_key_env must name OPENAI_API_KEY or a variable whose name is LLM_KEY_/,
    ],
    // A comma would grant one more variable in the --allow-env list.
    [deploymentsEnv([{ ...east, api_key_env: "LLM_KEY_EAST,HOME" }]), "LLM_DEPLOYMENTS", /\.api_key_env must name/],
    [deploymentsEnv([{ ...east, api_key_env: "LLM_KEY_" }]), "LLM_DEPLOYMENTS", /\.api_key_env must name/],
    [deploymentsEnv([{ ...east, models: [] }]), "LLM_DEPLOYMENTS", /\("east"\)\.models must list at least one model/],
    [deploymentsEnv([{ ...east, models: "gpt-4.1" }]), "LLM_DEPLOYMENTS", /\.models must be a list of model names/],
    [deploymentsEnv([{ ...east, models: ["gpt-4.1", ""] }]), "LLM_DEPLOYMENTS", /\.models\[1\] must not be empty/],
    [deploymentsEnv([{ ...east, models: ["a", "a"] }]), "LLM_DEPLOYMENTS", /\.models lists a model twice/],
    [
      deploymentsEnv([{ ...east, weight: 0 }]),
      "LLM_DEPLOYMENTS",
      /\.weight must be a whole number of at least 1 \(got 0\)/,
    ],
    [deploymentsEnv([{ ...east, weight: 1.5 }]), "LLM_DEPLOYMENTS", /\.weight must be a whole number.*\(got 1\.5\)/],
    [
      deploymentsEnv([{ ...east, rpm: -60 }]),
      "LLM_DEPLOYMENTS",
      /\("east"\)\.rpm must be a whole number of at least 1/,
    ],
    [deploymentsEnv([{ ...east, tpm: "1000" }]), "LLM_DEPLOYMENTS", /\("east"\)\.tpm must be a whole number/],
    [deploymentsEnv([{ ...east, batch: "yes" }]), "LLM_DEPLOYMENTS", /\("east"\)\.batch must be true or false/],
    [
      deploymentsEnv([{ ...east, weigth: 2 }]),
      "LLM_DEPLOYMENTS",
      /\("east"\) has an unknown field "weigth" \(it takes name, base_url/,
    ],
    [
      { LLM_DEPLOYMENTS: JSON.stringify([east]) },
      "LLM_KEY_EAST",
      /^Cannot start: LLM_KEY_EAST is not set, and LLM_DEPLOYMENTS\[0\] \("east"\) names it as its api_key_env$/,
    ],
    [deploymentsEnv([east], { LLM_KEY_EAST: "" }), "LLM_KEY_EAST", /LLM_KEY_EAST is empty, and LLM_DEPLOYMENTS\[0\]/],
    [
      deploymentsEnv([{ ...east, api_key_env: "OPENAI_API_KEY" }], { OPENAI_API_KEY: "" }),
      "OPENAI_API_KEY",
      /OPENAI_API_KEY is empty, and LLM_DEPLOYMENTS\[0\] \("east"\) names it/,
    ],
    [
      deploymentsEnv([east], { LLM_PROVIDER: "extractive" }),
      "LLM_PROVIDER",
      /LLM_PROVIDER=extractive is the embedded model, which takes no LLM_DEPLOYMENTS/,
    ],
    [deploymentsEnv([east], { LLM_RPM: "600" }), "LLM_RPM", /LLM_RPM limits the one deployment OPENAI_\* names/],
    [deploymentsEnv([east], { LLM_TPM: "60000" }), "LLM_TPM", /give each deployment its own "tpm"/],
    [{ LLM_FALLBACK_AFTER_S: "soon" }, "LLM_FALLBACK_AFTER_S", /LLM_FALLBACK_AFTER_S must be a number of seconds/],
    [{ LLM_FALLBACK_AFTER_S: "-1" }, "LLM_FALLBACK_AFTER_S", /LLM_FALLBACK_AFTER_S must be a number of seconds/],
  ];
  for (const [env, variable, message] of cases) {
    assert.throws(() => parseConfig(env), (e: unknown) => {
      assert.ok(e instanceof ConfigError, String(e));
      assert.equal(e.variable, variable, e.message);
      assert.match(e.message, message);
      assert.ok(!e.message.includes("\n"), "one line");
      assert.doesNotMatch(e.message, /sk-test/, "no key");
      return true;
    });
  }
});

Deno.test("LLM_DEPLOYMENTS: a key pasted into it is never printed", () => {
  const east = deployment("east");
  for (
    const entry of [
      { ...east, api_key_env: "sk-live-abcdef0123456789" },
      { ...east, api_key: "sk-live-abcdef0123456789" },
      { ...east, base_url: "https://user:sk-live-abcdef0123456789@" },
      { ...east, models: ["sk-live-abcdef0123456789", "sk-live-abcdef0123456789"] },
    ]
  ) {
    assert.throws(() => parseConfig(deploymentsEnv([entry])), (e: Error) => {
      assert.match(e.message, /^Cannot start: LLM_DEPLOYMENTS\[0\] \("east"\)/);
      assert.doesNotMatch(e.message, /sk-live/);
      return true;
    });
  }
});

Deno.test("deploymentKeyVariables() names the key variables a deployment may use, for the launcher to read", () => {
  const text = JSON.stringify([
    deployment("east"),
    deployment("west", { api_key_env: "OPENAI_API_KEY" }),
    deployment("again", { api_key_env: "LLM_KEY_EAST" }),
    deployment("bad", { api_key_env: "HOME" }),
    { api_key_env: "LLM_KEY_A,HOME" },
    null,
  ]);
  assert.deepEqual(deploymentKeyVariables(text), ["LLM_KEY_EAST", "OPENAI_API_KEY"]);
  for (const unreadable of [undefined, "", "[{", "{}"]) assert.deepEqual(deploymentKeyVariables(unreadable), []);
});

Deno.test("main.ts reads the key variable a deployment names, and says which one is unset", async () => {
  const run = (env: Record<string, string>) =>
    new Deno.Command(Deno.execPath(), {
      args: ["run", "--allow-env", "--allow-read", "--allow-net", "--allow-sys", "main.ts", "tenant", "list"],
      env: { ...env, REDIS_URL: "redis://127.0.0.1:1/0", DATABASE_URL: "postgres://postgres@127.0.0.1:1/postgres" },
      stdout: "piped",
      stderr: "piped",
    }).output();
  const unset = await run({ LLM_DEPLOYMENTS: JSON.stringify([deployment("east")]) });
  assert.equal(unset.code, 2);
  assert.match(new TextDecoder().decode(unset.stderr), /^Cannot start: LLM_KEY_EAST is not set, and LLM_DEPLOYMENTS/);
  // Set, the configuration is accepted: the command goes on to find Postgres down (exit 1, not 2).
  const set = await run(deploymentsEnv([deployment("east")]));
  assert.equal(set.code, 1, new TextDecoder().decode(set.stderr));
});
