import assert from "node:assert/strict";
import { OUTCOME_MIN_AGE_MS } from "../../src/processes/relay_process.ts";
import postgres from "postgres";
import { createResendMailer } from "../../src/mail/resend_mailer.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { type RelayOptions } from "../../src/outbox/relay.ts";
import { createRetention } from "../../src/retention/retention.ts";
import { cancelJob } from "../../src/jobs/job_store.ts";
import { commitResults } from "../../src/runs/commit.ts";
import { SUMMARY_READY_TOPIC, SUMMARY_WEBHOOK_TOPIC } from "../../src/runs/shapes.ts";
import {
  summaryEmailRenderer,
  summaryPayloadLoader,
  tenantHourlyLimit,
  tenantHourlyLimits,
} from "../../src/summaries/email.ts";
import { type FakeMailServer, type MailBehaviour, startFakeMail } from "../support/fake_mail_server.ts";
import { createTestDatabase, waitFor } from "../_support.ts";
import { relayTo } from "../support/fixtures.ts";

Deno.test("outbox relay", async (t) => {
  const db = await createTestDatabase();
  const sql = db.sql;
  const render = summaryEmailRenderer("summaries@example.com");
  const relayFor = (mail: FakeMailServer, options: Partial<RelayOptions> = {}) =>
    relayTo({ sql, mailUrl: mail.url }, { maxAttempts: 10, backoffBaseMs: 1_000, ...options });
  const addRows = async (n: number) => {
    const ids = Array.from({ length: n }, () => crypto.randomUUID());
    await commitResults(
      sql,
      ids.map((jobId) => ({ jobId, tenant: "acme", summary: `Summary of ${jobId}.`, notify: "ops@example.com" })),
    );
    return ids;
  };
  const reset = () => sql`TRUNCATE summaries, outbox, job_outcomes`;
  const row = async (jobId: string) =>
    (await sql`SELECT * FROM outbox WHERE dedupe_key = ${"summary_ready:" + jobId}`)[0]!;

  try {
    await t.step(
      "sends with the dedupe key as Idempotency-Key, the contract's body, and marks the row sent",
      async () => {
        await reset();
        const mail = startFakeMail();
        try {
          const [jobId] = await addRows(1);
          assert.equal(await relayFor(mail).runOnce(), 1);
          assert.equal(mail.delivered.length, 1);
          const email = mail.delivered[0]!;
          assert.equal(email.idempotencyKey, `summary_ready:${jobId}`);
          assert.deepEqual(email.to, ["ops@example.com"]);
          assert.equal(email.from, "summaries@example.com");
          assert.match(email.subject, new RegExp(jobId!));
          assert.match(email.text, new RegExp(`Summary of ${jobId}`));
          assert.deepEqual([...mail.authorizations], ["Bearer re_test"]);
          const r = await row(jobId!);
          assert.ok(r.sent_at);
          assert.equal(r.provider_message_id, email.id);
        } finally {
          await mail.close();
        }
      },
    );

    await t.step(
      "send-then-crash: the row goes out again with the same key, and the provider delivers once",
      async () => {
        await reset();
        const mail = startFakeMail();
        try {
          const [jobId] = await addRows(1);
          const a = relayFor(mail, { leaseMs: 100 });
          const claimed = await a.claim();
          assert.equal(claimed.length, 1);
          await summaryPayloadLoader(sql)(claimed); // the row references its summary
          // Relay A delivers, then dies before recording the send.
          await createResendMailer({ apiKey: "re_test", baseUrl: mail.url, timeoutMs: 2_000 })
            .send(render(claimed[0]!.topic, claimed[0]!.payload), claimed[0]!.dedupe_key, new AbortController().signal);
          assert.equal((await row(jobId!)).sent_at, null);
          await new Promise((r) => setTimeout(r, 150)); // A's lease expires
          assert.equal(await relayFor(mail).runOnce(), 1);
          assert.equal(mail.requests, 2, "we sent twice");
          assert.equal(mail.delivered.length, 1, "the provider delivered once");
          assert.ok((await row(jobId!)).sent_at);
        } finally {
          await mail.close();
        }
      },
    );

    await t.step("a provider that is down: attempts 1, next_attempt_at moves forward, a later pass sends", async () => {
      await reset();
      let down = true;
      const mail = startFakeMail((): MailBehaviour => (down ? { kind: "status", status: 503 } : { kind: "ok" }));
      try {
        const [jobId] = await addRows(1);
        const before = await row(jobId!);
        const relay = relayFor(mail, { backoffBaseMs: 200, random: () => 0.99 });
        await relay.runOnce();
        const after = await row(jobId!);
        assert.equal(after.attempts, 1);
        assert.match(after.last_error, /http_503/);
        assert.ok(after.next_attempt_at > before.next_attempt_at);
        assert.equal(after.sent_at, null);
        assert.equal(await relay.runOnce(), 0, "not due yet");
        down = false;
        await waitFor("the retry", async () => (await relay.runOnce()) === 1);
        assert.ok((await row(jobId!)).sent_at);
        assert.equal(mail.delivered.length, 1);
      } finally {
        await mail.close();
      }
    });

    await t.step("a 429 with Retry-After from the mail provider sets the next attempt that far out", async () => {
      await reset();
      const mail = startFakeMail((): MailBehaviour => ({
        kind: "status",
        status: 429,
        headers: { "retry-after": "120" },
      }));
      try {
        const [jobId] = await addRows(1);
        // With no Retry-After, random() = 0 would retry at once.
        const relay = relayFor(mail, { backoffBaseMs: 200, random: () => 0 });
        await relay.runOnce();
        const after = await row(jobId!);
        assert.equal(after.attempts, 1);
        const [next] = await sql<{ wait: number }[]>`
          SELECT extract(epoch FROM next_attempt_at - now())::float AS wait FROM outbox WHERE payload->>'job_id' = ${jobId!}`;
        assert.ok(next!.wait > 110 && next!.wait <= 120, `next attempt in ${next!.wait} s`);
        assert.equal(mail.requests, 1);
      } finally {
        await mail.close();
      }
    });

    await t.step("two relays on one batch of 200 rows: every row sent exactly once by us", async () => {
      await reset();
      const mail = startFakeMail(() => ({ kind: "ok", delayMs: 2 }));
      try {
        await addRows(200);
        const a = relayFor(mail), b = relayFor(mail);
        const drain = async (relay: ReturnType<typeof relayFor>) => {
          while ((await relay.runOnce()) > 0) { /* until nothing is due */ }
        };
        await Promise.all([drain(a), drain(b)]);
        assert.equal(mail.requests, 200, "no row was sent twice");
        assert.equal(new Set(mail.delivered.map((d) => d.idempotencyKey)).size, 200);
        const [c] = await sql<{ n: number }[]>`SELECT count(*)::int AS n FROM outbox WHERE sent_at IS NOT NULL`;
        assert.equal(c!.n, 200);
      } finally {
        await mail.close();
      }
    });

    await t.step("an expired lease is reclaimed; a live one is not", async () => {
      await reset();
      const mail = startFakeMail();
      try {
        await addRows(1);
        const a = relayFor(mail, { leaseMs: 200 });
        assert.equal((await a.claim()).length, 1);
        assert.equal((await relayFor(mail).claim()).length, 0, "the lease holds");
        await new Promise((r) => setTimeout(r, 250));
        assert.equal(await relayFor(mail).runOnce(), 1, "the expired lease is claimable");
        assert.equal(mail.delivered.length, 1);
      } finally {
        await mail.close();
      }
    });

    await t.step("a claim does not take a row that another relay made wait while the claim ran", async () => {
      await reset();
      // A session whose now() first waits for an advisory lock: the claim stops there, after its statement's
      // snapshot was taken (it saw the row due) and before it locks the row.
      await sql`CREATE SCHEMA IF NOT EXISTS claim_pause`;
      await sql`
        CREATE OR REPLACE FUNCTION claim_pause.now() RETURNS timestamptz LANGUAGE plpgsql AS $$
        BEGIN
          PERFORM pg_advisory_lock(4242);
          PERFORM pg_advisory_unlock(4242);
          RETURN pg_catalog.now();
        END $$`;
      const paused = postgres(db.url, {
        max: 1,
        onnotice: () => {},
        connection: { search_path: "claim_pause, pg_catalog, public" },
      });
      const gate = postgres(db.url, { max: 1, onnotice: () => {} });
      try {
        const [jobId] = await addRows(1);
        // Connected before the claim: once (1 run in ~500) a fresh client's first statement met no array
        // serializer and sent the claim's empty text[] as "" (postgres.js fetches array types on connect).
        await paused`SELECT 1`;
        await gate`SELECT pg_advisory_lock(4242)`;
        const claiming = relayTo({ sql: paused }).claim();
        await waitFor("the claim to stop after its snapshot", async () =>
          (await sql`
            SELECT 1 FROM pg_stat_activity
            WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = 'advisory'`).length > 0);
        // Meanwhile another relay makes the row wait (a destination backoff, a rate-limit deferral) and commits.
        await sql`UPDATE outbox SET next_attempt_at = now() + interval '1 hour'
          WHERE dedupe_key = ${"summary_ready:" + jobId}`;
        await gate`SELECT pg_advisory_unlock(4242)`;
        const claimed = await claiming;
        assert.deepEqual(claimed.map((r) => r.dedupe_key), [], "the row is not due any more: not claimed");
        const r = await row(jobId!);
        assert.equal(r.claim_token, null);
        assert.equal(r.locked_until, null);
      } finally {
        await paused.end();
        await gate.end();
      }
    });

    await t.step("a permanent 4xx marks the row failed after one attempt", async () => {
      await reset();
      const mail = startFakeMail(() => ({ kind: "status", status: 422 }));
      try {
        const [jobId] = await addRows(1);
        await relayFor(mail).runOnce();
        const r = await row(jobId!);
        assert.equal(r.attempts, 1);
        assert.ok(r.failed_at);
        assert.equal(r.sent_at, null);
        assert.equal(await relayFor(mail).runOnce(), 0, "a failed row is not retried");
        assert.equal(mail.requests, 1);
      } finally {
        await mail.close();
      }
    });

    await t.step("Resend's two 409s: in flight is retried, key reused with another payload is permanent", async () => {
      await reset();
      const inFlight = startFakeMail(() => ({
        kind: "status",
        status: 409,
        body: { statusCode: 409, name: "concurrent_idempotent_requests", message: "in progress" },
      }));
      const reused = startFakeMail(() => ({
        kind: "status",
        status: 409,
        body: { statusCode: 409, name: "invalid_idempotent_request", message: "different payload" },
      }));
      try {
        const [a, b] = await addRows(2);
        await sql`UPDATE outbox SET next_attempt_at = now() + interval '1 hour' WHERE dedupe_key = ${
          "summary_ready:" + b
        }`;
        await relayFor(inFlight).runOnce();
        assert.equal((await row(a!)).failed_at, null);
        assert.equal((await row(a!)).attempts, 1);
        await sql`UPDATE outbox SET next_attempt_at = now()`;
        await sql`UPDATE outbox SET next_attempt_at = now() + interval '1 hour' WHERE dedupe_key = ${
          "summary_ready:" + a
        }`;
        await relayFor(reused).runOnce();
        assert.ok((await row(b!)).failed_at);
      } finally {
        await inFlight.close();
        await reused.close();
      }
    });

    await t.step("RELAY_MAX_ATTEMPTS failures mark the row failed", async () => {
      await reset();
      const mail = startFakeMail(() => ({ kind: "status", status: 500 }));
      try {
        const [jobId] = await addRows(1);
        const relay = relayFor(mail, { maxAttempts: 3, backoffBaseMs: 1 });
        for (let i = 0; i < 3; i++) await waitFor("a pass", async () => (await relay.runOnce()) === 1);
        const r = await row(jobId!);
        assert.equal(r.attempts, 3);
        assert.ok(r.failed_at);
        assert.equal(mail.requests, 3);
      } finally {
        await mail.close();
      }
    });

    await t.step("LISTEN wake-up: a committed row is sent without waiting for the poll interval", async () => {
      await reset();
      const mail = startFakeMail();
      const relay = relayFor(mail, { pollMs: 60_000 });
      const stop = new AbortController();
      const running = relay.run(stop.signal);
      try {
        await new Promise((r) => setTimeout(r, 200)); // the first pass found nothing and sleeps for a minute
        const started = performance.now();
        await addRows(1);
        await waitFor("the email", () => mail.delivered.length === 1, 3_000);
        assert.ok(performance.now() - started < 1_000);
      } finally {
        stop.abort();
        await running;
        await mail.close();
      }
    });

    await t.step("retention deletes only sent rows older than the age", async () => {
      await reset();
      const mail = startFakeMail();
      try {
        const [oldSent, newSent, oldUnsent] = await addRows(3);
        await sql`UPDATE outbox SET sent_at = now() - interval '10 days' WHERE dedupe_key = ${
          "summary_ready:" + oldSent
        }`;
        await sql`UPDATE outbox SET sent_at = now() WHERE dedupe_key = ${"summary_ready:" + newSent}`;
        await sql`UPDATE outbox SET created_at = now() - interval '10 days' WHERE dedupe_key = ${
          "summary_ready:" + oldUnsent
        }`;
        const retention = createRetention({ sql, log: silentLogger }, {
          outboxRetentionMs: 7 * 24 * 3600 * 1000,
          outcomeMinAgeMs: OUTCOME_MIN_AGE_MS,
        });
        assert.equal(await retention.runOnce(), 1);
        const left = await sql<{ dedupe_key: string }[]>`SELECT dedupe_key FROM outbox ORDER BY dedupe_key`;
        assert.deepEqual(
          left.map((r) => r.dedupe_key).sort(),
          [`summary_ready:${newSent}`, `summary_ready:${oldUnsent}`].sort(),
        );
      } finally {
        await mail.close();
      }
    });
    await t.step("SUMMARY_RETENTION_S deletes old summaries, except those whose email is still unsent", async () => {
      await reset();
      const mail = startFakeMail();
      try {
        const [oldSent, oldUnsent, recent] = await addRows(3);
        await sql`UPDATE summaries SET created_at = now() - interval '40 days' WHERE job_id IN (${oldSent!}, ${oldUnsent!})`;
        await sql`UPDATE outbox SET sent_at = now() WHERE dedupe_key IN (${"summary_ready:" + oldSent}, ${
          "summary_ready:" + recent
        })`;
        const retention = createRetention({ sql, log: silentLogger }, {
          summaryRetentionMs: 30 * 24 * 3600 * 1000,
          outcomeMinAgeMs: OUTCOME_MIN_AGE_MS,
        });
        assert.equal(await retention.runOnce(), 1);
        const left = await sql<{ job_id: string }[]>`SELECT job_id::text FROM summaries`;
        assert.deepEqual(left.map((r) => r.job_id).sort(), [oldUnsent!, recent!].sort());
        // The purged job stays finished: its outcome row is kept, so a late cancel cannot "cancel" it.
        assert.equal(await cancelJob(sql, oldSent!, "acme"), "done");
        const [outcome] = await sql`SELECT outcome FROM job_outcomes WHERE job_id = ${oldSent!}`;
        assert.equal(outcome!.outcome, "done");
        // Once nothing can ask about it any more (8 days, and past SUMMARY_RETENTION_S), the outcome goes too.
        await sql`UPDATE job_outcomes SET decided_at = now() - interval '40 days' WHERE job_id = ${oldSent!}`;
        assert.equal(await retention.runOnce(), 1);
        assert.equal((await sql`SELECT 1 FROM job_outcomes WHERE job_id = ${oldSent!}`).length, 0);
        assert.equal((await sql`SELECT 1 FROM job_outcomes`).length, 3 - 1, "the others' outcomes stay");
        // Unset: summaries are kept.
        await sql`UPDATE summaries SET created_at = now() - interval '400 days'`;
        assert.equal(
          await createRetention({ sql, log: silentLogger }, { outcomeMinAgeMs: OUTCOME_MIN_AGE_MS }).runOnce(),
          0,
        );
      } finally {
        await mail.close();
      }
    });
    await t.step(
      "a send gives its slot to the next row once the provider answered, while its mark is written (at most RELAY_BATCH marks pending)",
      async () => {
        await reset();
        await addRows(4);
        // The first email's answer waits until its row is locked here, so that its mark (an UPDATE) blocks.
        let firstKey: string | null = null;
        const mail = startFakeMail((n, key) => {
          if (n === 1) firstKey = key;
          return n === 1 ? { kind: "ok", delayMs: 400 } : { kind: "ok" };
        });
        const lock = await sql.reserve();
        const stop = new AbortController();
        // One slot: before, the first row held it until its mark was written, and nothing else went out.
        const running = relayFor(mail, { batch: 1 }).run(stop.signal);
        try {
          await waitFor("the first send", () => firstKey !== null);
          await lock`BEGIN`;
          await lock`SELECT 1 FROM outbox WHERE dedupe_key = ${firstKey!} FOR UPDATE`;
          // Its mark is blocked; its slot went to the second row, which went out too. The second keeps its slot
          // (one mark pending already, the most for one slot), so no third goes out meanwhile.
          await waitFor("the second email", () => mail.delivered.length === 2);
          await new Promise((resolve) => setTimeout(resolve, 300));
          assert.equal(mail.delivered.length, 2, "at most one send in flight and one mark pending");
          await lock`ROLLBACK`;
          await waitFor("every row marked sent", async () => {
            const [row] = await sql<{ unsent: number }[]>`
              SELECT count(*)::int AS unsent FROM outbox WHERE sent_at IS NULL`;
            return row!.unsent === 0;
          });
          assert.equal(mail.delivered.length, 4);
          assert.equal(new Set(mail.delivered.map((e) => e.idempotencyKey)).size, 4, "each row sent once");
          assert.equal(mail.requests, 4, "and asked once");
        } finally {
          await lock`ROLLBACK`.catch(() => {});
          lock.release();
          stop.abort();
          await running;
          await mail.close();
        }
      },
    );

    await t.step("a send cut off by the relay's own shutdown is neither failed nor charged an attempt", async () => {
      await reset();
      // A receiver that accepts the connection and never answers: the send outlasts the 5 s shutdown grace.
      const hanging = Deno.listen({ hostname: "127.0.0.1", port: 0 });
      const held: Deno.Conn[] = [];
      (async () => {
        for await (const conn of hanging) held.push(conn);
      })().catch(() => {});
      try {
        const jobId = crypto.randomUUID();
        await commitResults(sql, [{
          jobId,
          tenant: "acme",
          summary: "S.",
          notify: { webhook: `http://127.0.0.1:${hanging.addr.port}/hook` },
        }]);
        await sql`INSERT INTO tenants (name, webhook_secret) VALUES ('acme', ${"whsec_" + btoa("a".repeat(24))})
          ON CONFLICT (name) DO UPDATE SET webhook_secret = EXCLUDED.webhook_secret`;
        // The send may take 30 s: longer than the relay's 5 s shutdown grace.
        const relay = relayTo({ sql, webhookTimeoutMs: 30_000 }, { leaseMs: 60_000 });
        const stop = new AbortController();
        const running = relay.run(stop.signal);
        await waitFor("the send to start", () => held.length > 0, 5_000);
        stop.abort();
        await running;
        const [row] = await sql`SELECT attempts, failed_at, sent_at FROM outbox WHERE payload->>'job_id' = ${jobId}`;
        assert.equal(row!.failed_at, null, "not failed by our own shutdown");
        assert.equal(row!.attempts, 0, "and not charged an attempt: the lease runs out and it goes again");
        assert.equal(row!.sent_at, null);
      } finally {
        hanging.close();
        for (const conn of held) conn.close();
      }
    });

    await t.step(
      "MAIL_TENANT_HOURLY_LIMIT: rows over a tenant's hourly limit wait, without an attempt; others go",
      async () => {
        await reset();
        const mail = startFakeMail();
        try {
          await addRows(5); // acme
          const other = crypto.randomUUID();
          await commitResults(sql, [{ jobId: other, tenant: "globex", summary: "S.", notify: "g@example.com" }]);
          const relay = relayTo({ sql, mailUrl: mail.url, defer: tenantHourlyLimit(sql, 3) }, { maxAttempts: 10 });
          assert.equal(await relay.runOnce(), 6, "all claimed");
          assert.equal(mail.delivered.length, 4, "three of acme's and globex's one");
          const waiting = await sql<{ attempts: number; wait: number }[]>`
          SELECT attempts, extract(epoch FROM next_attempt_at - now())::float AS wait FROM outbox WHERE sent_at IS NULL`;
          assert.equal(waiting.length, 2);
          for (const w of waiting) {
            assert.equal(w.attempts, 0, "a deferral is not an attempt");
            assert.ok(w.wait > 50 && w.wait <= 60);
          }
          assert.equal(await relay.runOnce(), 0, "not due yet");
          assert.equal(mail.requests, 4);
        } finally {
          await mail.close();
        }
      },
    );

    await t.step(
      "WEBHOOK_TENANT_HOURLY_LIMIT caps a tenant's webhooks as MAIL_TENANT_HOURLY_LIMIT caps its emails",
      async () => {
        await reset();
        const ids = Array.from({ length: 7 }, () => crypto.randomUUID());
        await commitResults(
          sql,
          ids.map((jobId, i) => ({
            jobId,
            tenant: "acme",
            summary: "S.",
            notify: i < 5 ? { webhook: `https://hooks.example.com/${i}` } : `ops${i}@example.com`,
          })),
        );
        const claimed = await relayTo({ sql }).claim();
        assert.equal(claimed.length, 7);
        const webhooksOnly = await tenantHourlyLimits(sql, { [SUMMARY_WEBHOOK_TOPIC]: 3 })(claimed);
        const deferred = (waits: Map<string, number>) =>
          claimed.filter((r) => waits.has(r.id)).map((r) => r.topic).sort();
        assert.deepEqual(deferred(webhooksOnly), [SUMMARY_WEBHOOK_TOPIC, SUMMARY_WEBHOOK_TOPIC], "emails uncapped");
        const both = await tenantHourlyLimits(sql, { [SUMMARY_WEBHOOK_TOPIC]: 3, [SUMMARY_READY_TOPIC]: 1 })(claimed);
        assert.deepEqual(deferred(both), [SUMMARY_READY_TOPIC, SUMMARY_WEBHOOK_TOPIC, SUMMARY_WEBHOOK_TOPIC]);
        for (const ms of both.values()) assert.equal(ms, 60_000);
      },
    );
  } finally {
    await db.close();
  }
});
