import assert from "node:assert/strict";
import { ConfigError, parseConfig } from "../src/config.ts";

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
