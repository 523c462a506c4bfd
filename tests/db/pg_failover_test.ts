/**
 * Postgres with a standby: DATABASE_URL lists both hosts with
 * target_session_attrs=read-write, and the service follows a failover (the
 * primary crashes, the synchronous standby is promoted) without a restart:
 * the same pool writes again, `/readyz` is 200 again, a `Prefer: wait` is
 * woken by the new primary's NOTIFY, the worker and the relay carry on, and
 * what was committed and acknowledged before is still there.
 */
import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { connectPostgres } from "../../src/clients.ts";
import { ConfigError, parseConfig, postgresHosts, redactUrl } from "../../src/config.ts";
import { checkCommitDurability } from "../../src/db/commit_durability.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { createLogger } from "../../src/log/logger.ts";
import { permissionFlags, requiredHosts } from "../../src/permissions.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, relayTo, summaryWorker } from "../support/fixtures.ts";
import { startPgStandby } from "../support/pg_standby.ts";
import { createTestRedis, recordingLogger, waitFor } from "../_support.ts";

const MULTI = "postgres://app:secret@db1:5432,db2:5433/oncely?target_session_attrs=read-write";

Deno.test("DATABASE_URL with several hosts needs target_session_attrs=read-write or primary", () => {
  assert.equal(parseConfig({ DATABASE_URL: MULTI }).DATABASE_URL, MULTI);
  parseConfig({ DATABASE_URL: MULTI.replace("read-write", "primary") });
  parseConfig({ DATABASE_URL: "postgres://u@db1:5432/x?target_session_attrs=read-write" });
  const refused: [string, RegExp][] = [
    [
      "postgres://app:secret@db1:5432,db2:5433/oncely",
      /lists 2 hosts \(db1:5432,db2:5433\) but no target_session_attrs: add \?target_session_attrs=read-write/,
    ],
    [MULTI.replace("read-write", "any"), /target_session_attrs must be read-write or primary \(got "any"\)/],
    [MULTI.replace("read-write", "prefer-standby"), /must be read-write or primary \(got "prefer-standby"\)/],
    ["postgres://u@db1:5432/x?target_session_attrs=standby", /must be read-write or primary \(got "standby"\)/],
    ["postgres://app:secret@[::1]:5432,db2:5433/x?target_session_attrs=read-write", /an IPv6 address only alone/],
    ["postgres://app:secret@db1:5432,,db2/x?target_session_attrs=read-write", /comma-separated list of host:port/],
  ];
  for (const [url, message] of refused) {
    assert.throws(() => parseConfig({ DATABASE_URL: url }), (e: unknown) => {
      assert.ok(e instanceof ConfigError);
      assert.equal(e.variable, "DATABASE_URL");
      assert.match(e.message, message);
      assert.doesNotMatch(e.message, /secret/);
      return true;
    });
  }
});

Deno.test("every host of DATABASE_URL is in the permission set; a host without a port gets the first one's", () => {
  assert.deepEqual(postgresHosts(MULTI), ["db1:5432", "db2:5433"]);
  assert.deepEqual(postgresHosts("postgres://u@db1:6000,db2/x"), ["db1:6000", "db2:6000"]);
  assert.deepEqual(postgresHosts("postgres://u@db1,db2/x"), ["db1:5432", "db2:5432"]);
  assert.deepEqual(postgresHosts("postgres://u@[::1]/x"), ["[::1]:5432"]);
  const config = parseConfig({ DATABASE_URL: MULTI });
  assert.deepEqual(requiredHosts(config, { postgres: true }), {
    DATABASE_URL: "db1:5432",
    "DATABASE_URL[1]": "db2:5433",
  });
  const net = permissionFlags("worker", config, "/m").find((flag) => flag.startsWith("--allow-net="))!;
  assert.ok(net.includes("db1:5432") && net.includes("db2:5433"), net);
  assert.equal(redactUrl(MULTI), "postgres://app:***@db1:5432,db2:5433/oncely?target_session_attrs=read-write");
});

/** Runs `main.ts tenant list` on `url` and returns its stderr (start-up warnings are JSON lines there). */
async function startUpLines(url: string): Promise<string> {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "--allow-env", "--allow-read", "--allow-net", "--allow-sys", "main.ts", "tenant", "list"],
    env: { DATABASE_URL: url, NO_COLOR: "1" },
    stdout: "null",
    stderr: "piped",
  }).output();
  const stderr = new TextDecoder().decode(out.stderr);
  assert.equal(out.code, 0, stderr);
  return stderr;
}

Deno.test("a pool on a primary and its synchronous standby follows a failover without a restart", async (t) => {
  let sql: Sql | undefined;
  const r = await createTestRedis();
  const pg = await startPgStandby().catch(async (error) => {
    await r.close();
    throw error;
  });
  const mail = startFakeMail();
  // The second job's model call takes a second, so a wait on it starts before its commit.
  const model = startFakeModel((_, prompt) => ({ kind: "ok", delayMs: prompt.includes("SLOW") ? 1_000 : 0 }));
  const stop = new AbortController();
  const running: Promise<void>[] = [];
  const closers: (() => Promise<void>)[] = [];
  try {
    await t.step("the start-up warning names the risk for an asynchronous standby only", async () => {
      assert.doesNotMatch(await startUpLines(pg.url), /postgres_standby_asynchronous/);
      const direct = await connectPostgres(pg.url);
      try {
        const sync = await checkCommitDurability({ sql: direct, log: createLogger({ write: () => {} }) });
        assert.deepEqual(sync, { synchronousCommit: "on", synchronousStandbyNames: "*", survivesFailover: true });
        // A session may turn it off for itself (a role, a database, or the URL can): that is what counts.
        const local = await connectPostgres(`${pg.url}&synchronous_commit=local`);
        const lines = recordingLogger();
        try {
          const got = await checkCommitDurability({ sql: local, log: createLogger({ write: lines.write }) });
          assert.equal(got.survivesFailover, false);
        } finally {
          await local.end();
        }
        assert.equal(lines.lines.length, 1);
        assert.equal(lines.lines[0]!.event, "postgres_standby_asynchronous");
        assert.match(String(lines.lines[0]!.risk), /committed and acknowledged may be missing on the new primary/);

        await direct`ALTER SYSTEM SET synchronous_standby_names = ''`;
        await direct`SELECT pg_reload_conf()`;
        const stderr = await startUpLines(pg.url);
        const warning = stderr.split("\n").find((line) => line.includes("postgres_standby_asynchronous"));
        assert.ok(warning, stderr);
        assert.equal(JSON.parse(warning).synchronous_standby_names, "");
      } finally {
        await direct`ALTER SYSTEM SET synchronous_standby_names = '*'`;
        await direct`SELECT pg_reload_conf()`;
        await waitFor("the standby to be synchronous again", async () => {
          const rows = await direct<{ sync_state: string }[]>`SELECT sync_state FROM pg_stat_replication`;
          return rows.some((row) => row.sync_state === "sync");
        });
        await direct.end();
      }
    });

    await t.step("with the standby listed first, every pool connection still lands on the primary", async () => {
      const swapped = pg.url.replace(
        `127.0.0.1:${pg.primaryPort},127.0.0.1:${pg.standbyPort}`,
        `127.0.0.1:${pg.standbyPort},127.0.0.1:${pg.primaryPort}`,
      );
      const pool = await connectPostgres(swapped, { max: 4 });
      try {
        await pool`CREATE TABLE failover_probe (id int PRIMARY KEY, at text NOT NULL)`;
        // Four at once open four connections, each trying the standby first.
        await Promise.all([1, 2, 3, 4].map((id) => pool`INSERT INTO failover_probe VALUES (${id}, 'before')`));
      } finally {
        await pool.end();
      }
    });

    sql = await connectPostgres(pg.url);
    const db = sql;
    const keys = serviceKeys(r.prefix);
    const listenerLog = recordingLogger();
    const waiter = await createJobWaiter({ sql: db, log: createLogger({ write: listenerLog.write }) });
    closers.push(() => waiter.close());
    const handler = apiHandler({ redis: r.redis, sql: db, keys }, { authMode: "api-key", waiter });
    const apiKey = await createApiKey(db, "acme");
    const llm = createOpenAiLlm({ apiKey: "k", model: "m", baseURL: model.url });
    const worker = summaryWorker({ redis: r.redis, sql: db, llm, keys }, { graceMs: 1_000 });
    closers.push(() => worker.close());
    running.push(worker.run(stop.signal));
    const relay = relayTo({ sql: db, mailUrl: mail.url }, { pollMs: 500 });
    running.push(relay.run(stop.signal));
    const post = (text: string, prefer?: string) =>
      handler(
        new Request("http://api/v1/summaries", {
          method: "POST",
          headers: {
            authorization: `Bearer ${apiKey}`,
            "content-type": "application/json",
            "idempotency-key": `failover-${crypto.randomUUID()}`,
            ...(prefer ? { prefer } : {}),
          },
          body: JSON.stringify({ text, notify: "ops@example.com" }),
        }),
      );
    const get = (jobId: string, prefer?: string) =>
      handler(
        new Request(`http://api/v1/summaries/${jobId}`, {
          headers: { authorization: `Bearer ${apiKey}`, ...(prefer ? { prefer } : {}) },
        }),
      );
    const readyz = async () => {
      const res = await handler(new Request("http://api/readyz"));
      await res.body?.cancel();
      return res.status;
    };
    let before = "";

    await t.step("before: a job is done and acknowledged, its email sent", async () => {
      assert.equal(await readyz(), 200);
      const res = await post("Before the failover. The primary answers.", "wait=10");
      assert.equal(res.status, 200);
      const doc = await res.json();
      assert.equal(doc.status, "done");
      before = doc.job_id;
      await waitFor("the first email", () => mail.delivered.length === 1, 10_000);
      await db`INSERT INTO failover_probe VALUES (5, 'before')`;
    });

    await t.step("failover: the same pool writes again, /readyz is 200 again, within 10 s", async () => {
      const stopped = performance.now();
      await pg.stopPrimaryImmediate();
      // No host is the primary until the promotion: readiness says so.
      assert.equal(await readyz(), 503);
      await pg.promoteStandby();
      const promoted = performance.now();
      // One write through the pool, tried until it lands (each try bounded, as a request would be).
      let n = 100;
      await waitFor("a write on the new primary", async () => {
        const id = ++n;
        const write = db`INSERT INTO failover_probe VALUES (${id}, 'after')`.then(() => true, () => false);
        return await Promise.race([write, new Promise<false>((resolve) => setTimeout(() => resolve(false), 1_000))]);
      }, 10_000);
      const written = performance.now();
      await waitFor("/readyz 200", async () => (await readyz()) === 200, 10_000);
      const ready = performance.now();
      console.log(
        `failover: promote took ${Math.round(promoted - stopped)} ms after the stop; first write ` +
          `${Math.round(written - promoted)} ms and /readyz 200 ${Math.round(ready - promoted)} ms after the promotion`,
      );
      assert.ok(ready - promoted < 10_000);
    });

    await t.step("after: what was committed and acknowledged before is on the new primary", async () => {
      const rows = await db<{ id: number }[]>`SELECT id FROM failover_probe WHERE at = 'before' ORDER BY id`;
      assert.deepEqual(rows.map((row) => row.id), [1, 2, 3, 4, 5]);
      const res = await get(before);
      assert.equal((await res.json()).status, "done");
      const [count] = await db<{ summaries: number }[]>`
        SELECT count(*)::int AS summaries FROM summaries WHERE job_id = ${before}`;
      assert.equal(count!.summaries, 1);
    });

    await t.step("after: a Prefer: wait is woken by the new primary's NOTIFY; worker and relay carry on", async () => {
      await waitFor("the job listener on the new primary", () => {
        return listenerLog.lines.some((line) => line.event === "job_listener_reconnected");
      }, 10_000);
      const accepted = await post("After the failover. SLOW model. The standby took over.");
      assert.equal(accepted.status, 202);
      const { job_id } = await accepted.json();
      const asked = performance.now();
      const res = await get(job_id, "wait=30");
      const waited = performance.now() - asked;
      assert.equal(res.status, 200);
      assert.equal((await res.json()).status, "done");
      // Without the NOTIFY it would answer only after the 30 s.
      assert.ok(waited < 10_000, `answered after ${Math.round(waited)} ms`);
      await waitFor("the second email", () => mail.delivered.length === 2, 10_000);
      assert.equal(mail.requests, 2);
    });
  } finally {
    stop.abort();
    await Promise.all(running);
    for (const close of closers.reverse()) await close();
    await sql?.end({ timeout: 1 });
    await r.close();
    await mail.close();
    await model.close();
    await pg.stop();
  }
});
