/**
 * A "sent" mark that fails (its connection drops while the UPDATE runs) is written again within the row's
 * lease, so the row is not sent a second time when the lease runs out: a webhook receiver, unlike the mail
 * provider, may not dedupe on the key. The fault is Postgres's own: a trigger that ends its session's
 * connection on the first marks.
 */
import assert from "node:assert/strict";
import { createLogger } from "../../src/log/logger.ts";
import { RELAY_TUNING } from "../../src/outbox/relay.ts";
import { commitResults } from "../../src/runs/commit.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { startFakeWebhookReceiver } from "../support/fake_webhook_receiver.ts";
import { relayTo } from "../support/fixtures.ts";
import { createTestDatabase, recordingLogger, waitFor } from "../_support.ts";

const SECRET = `whsec_${btoa("mark-retry-test-secret-24")}`;

Deno.test("relay: a failed sent mark is written again within the lease", async (t) => {
  const db = await createTestDatabase();
  const sql = db.sql;
  await sql`INSERT INTO tenants (name, webhook_secret) VALUES ('acme', ${SECRET})`;
  // The first `faults` marks (counted by a sequence, which a rollback does not undo) end their own connection.
  await sql`CREATE SEQUENCE mark_fault_seq`;
  await sql`CREATE TABLE mark_fault_plan (faults int NOT NULL)`;
  await sql`INSERT INTO mark_fault_plan VALUES (0)`;
  await sql`
    CREATE FUNCTION mark_fault() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF nextval('mark_fault_seq') <= (SELECT faults FROM mark_fault_plan) THEN
        PERFORM pg_terminate_backend(pg_backend_pid());
        PERFORM pg_sleep(5);
      END IF;
      RETURN NEW;
    END $$`;
  await sql`
    CREATE TRIGGER mark_fault BEFORE UPDATE ON outbox FOR EACH ROW
    WHEN (OLD.sent_at IS NULL AND NEW.sent_at IS NOT NULL) EXECUTE FUNCTION mark_fault()`;
  const planFaults = async (faults: number) => {
    await sql`ALTER SEQUENCE mark_fault_seq RESTART`;
    await sql`UPDATE mark_fault_plan SET faults = ${faults}`;
  };
  const marksTried = async () => {
    const [seq] = await sql<{ n: number }[]>`SELECT CASE WHEN is_called THEN last_value ELSE 0 END::int AS n
      FROM mark_fault_seq`;
    return seq!.n;
  };
  const unsent = async () => (await sql`SELECT id FROM outbox WHERE sent_at IS NULL`).length;
  const reset = () => sql`TRUNCATE summaries, outbox, job_outcomes`;

  try {
    await t.step("a mark lost with its connection twice: one POST to the receiver and one email", async () => {
      await reset();
      await planFaults(2);
      const mail = startFakeMail();
      const receiver = startFakeWebhookReceiver(new Map([["acme", SECRET]]));
      try {
        await commitResults(sql, [
          { jobId: crypto.randomUUID(), tenant: "acme", summary: "S.", notify: { webhook: `${receiver.url}/acme` } },
          { jobId: crypto.randomUUID(), tenant: "acme", summary: "S.", notify: "ops@example.com" },
        ]);
        assert.equal(await relayTo({ sql, mailUrl: mail.url }, { leaseMs: 10_000 }).runOnce(), 2);
        // The lease runs out, and another relay looks for rows to send.
        await sql`UPDATE outbox SET locked_until = now() - interval '1 second' WHERE locked_until IS NOT NULL`;
        const again = await relayTo({ sql, mailUrl: mail.url }).runOnce();
        assert.equal(receiver.requests, 1, "the receiver got one POST");
        assert.equal(receiver.redelivered, 0);
        assert.equal(mail.requests, 1, "the provider got one send");
        assert.equal(again, 0, "nothing was left to send again");
        assert.equal(await unsent(), 0);
        assert.ok(await marksTried() >= 3, "two marks failed, and a later one went through");
      } finally {
        await receiver.close();
        await mail.close();
      }
    });

    await t.step(
      "a mark that keeps failing is given up a margin before the lease ends; the lease sends again with its key",
      async () => {
        await reset();
        await planFaults(1_000);
        const leaseMs = 2_500;
        const mail = startFakeMail();
        const logged = recordingLogger();
        try {
          await commitResults(sql, [
            { jobId: crypto.randomUUID(), tenant: "acme", summary: "S.", notify: "ops@example.com" },
          ]);
          const relay = relayTo({ sql, mailUrl: mail.url, log: createLogger({ level: "info", write: logged.write }) }, {
            leaseMs,
          });
          const started = performance.now();
          assert.equal(await relay.runOnce(), 1);
          const elapsed = performance.now() - started;
          assert.ok(elapsed < leaseMs - RELAY_TUNING.markLeaseMarginMs / 2, `gave up after ${elapsed} ms`);
          const retries = logged.lines.filter((l) => l.event === "outbox_mark_retry");
          assert.ok(retries.length >= 2, `tried again ${retries.length} times`);
          const gaveUp = logged.lines.find((l) => l.event === "outbox_record_failed");
          assert.equal(gaveUp?.gave_up, true);
          assert.equal(await unsent(), 1);
          // Postgres is back; the lease ends and the row goes again, with the same Idempotency-Key.
          await planFaults(0);
          await waitFor("the lease to end and the row to go again", async () => (await relay.runOnce()) === 1, 5_000);
          assert.equal(mail.requests, 2);
          assert.equal(mail.delivered.length, 1, "the provider delivered once");
          assert.equal(await unsent(), 0);
        } finally {
          await mail.close();
        }
      },
    );
  } finally {
    await db.close();
  }
});
