/**
 * Issue 20, the relay's part: a slow receiver delays only its own rows. The
 * real relay with the real HTTP senders, a local Resend-compatible server, and
 * a webhook receiver that accepts connections and never answers. Every time
 * is measured from outside, by polling what the servers received. The later
 * steps cover the review of the first version: a backlog deeper than a claim
 * looked (500 rows), one tenant's webhooks spread over many hosts, and a slow
 * but healthy destination alone.
 */
import assert from "node:assert/strict";
import type { RelayOptions } from "../../src/outbox/relay.ts";
import { commitResults } from "../../src/runs/commit.ts";
import { createLogger } from "../../src/log/logger.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { startFakeWebhookReceiver } from "../support/fake_webhook_receiver.ts";
import { relayTo } from "../support/fixtures.ts";
import { createTestDatabase, recordingLogger, type TestDatabase, waitFor } from "../_support.ts";

const SECRET = `whsec_${btoa("isolation-test-secret-24b")}`;

/** Connections open at once across several receivers (one tenant's hosts), and the most there ever were. */
interface OpenCount {
  open: number;
  maxOpen: number;
}

/**
 * A receiver that accepts every connection, reads the request and never answers. Its connections are also
 * counted in `group`, when given.
 */
function startHangingReceiver(group: OpenCount = { open: 0, maxOpen: 0 }) {
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const open = new Set<Deno.Conn>();
  const readers: Promise<void>[] = [];
  let accepted = 0;
  let maxOpen = 0;
  const drain = async (conn: Deno.Conn) => {
    const buffer = new Uint8Array(4096);
    try {
      while ((await conn.read(buffer)) !== null) { /* never answer */ }
    } catch { /* closed by close() */ }
    if (open.delete(conn)) {
      group.open--;
      conn.close();
    }
  };
  const accepting = (async () => {
    for await (const conn of listener) {
      accepted++;
      open.add(conn);
      group.open++;
      maxOpen = Math.max(maxOpen, open.size);
      group.maxOpen = Math.max(group.maxOpen, group.open);
      readers.push(drain(conn));
    }
  })().catch(() => {});
  const host = `127.0.0.1:${listener.addr.port}`;
  return {
    url: `http://${host}/hooks/hanging`,
    host,
    /** Connections accepted so far. */
    get accepted() {
      return accepted;
    },
    /** Connections the relay holds open right now (its sends in flight to this host). */
    get open() {
      return open.size;
    },
    get maxOpen() {
      return maxOpen;
    },
    async close() {
      listener.close();
      group.open -= open.size;
      for (const conn of open) conn.close();
      open.clear();
      await accepting;
      await Promise.all(readers);
    },
  };
}

/** A receiver that is slow but healthy: it answers every request 204, `delayMs` after it arrived. */
function startSlowReceiver(delayMs: number) {
  const state = { open: 0, maxOpen: 0, answered: 0 };
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
    state.open++;
    state.maxOpen = Math.max(state.maxOpen, state.open);
    try {
      await req.arrayBuffer();
      await new Promise((r) => setTimeout(r, delayMs));
      state.answered++;
      return new Response(null, { status: 204 });
    } finally {
      state.open--;
    }
  });
  return {
    url: `http://127.0.0.1:${server.addr.port}/hooks/slow`,
    /** Requests being answered right now (the relay's sends in flight to this host). */
    get open() {
      return state.open;
    },
    get maxOpen() {
      return state.maxOpen;
    },
    get answered() {
      return state.answered;
    },
    close: () => server.shutdown(),
  };
}

async function addTenant(db: TestDatabase, name: string) {
  await db.sql`INSERT INTO tenants (name, webhook_secret) VALUES (${name}, ${SECRET})
    ON CONFLICT (name) DO UPDATE SET webhook_secret = EXCLUDED.webhook_secret`;
}

async function queueWebhooks(db: TestDatabase, tenant: string, url: string, n: number): Promise<string[]> {
  const ids = Array.from({ length: n }, () => crypto.randomUUID());
  await commitResults(db.sql, ids.map((jobId) => ({ jobId, tenant, summary: "S.", notify: { webhook: url } })));
  return ids;
}

/** Commits one email job for `tenant` and returns how long, from before its commit, the provider took to receive it. */
async function timeEmail(
  db: TestDatabase,
  mail: ReturnType<typeof startFakeMail>,
  tenant: string,
): Promise<number> {
  const jobId = crypto.randomUUID();
  const started = performance.now();
  await commitResults(db.sql, [{ jobId, tenant, summary: "Revenue rose.", notify: "ops@example.com" }]);
  await waitFor(`the email of ${jobId}`, () => mail.delivered.some((e) => e.idempotencyKey?.endsWith(jobId)), 10_000);
  return performance.now() - started;
}

interface OutboxState {
  attempts: number;
  failed: boolean;
  sent: boolean;
  wait_s: number;
}

function outboxOf(db: TestDatabase, ids: string[]) {
  return db.sql<OutboxState[]>`
    SELECT attempts, failed_at IS NOT NULL AS failed, sent_at IS NOT NULL AS sent,
      extract(epoch FROM next_attempt_at - now())::float AS wait_s
    FROM outbox WHERE payload->>'job_id' = ANY(${ids}) ORDER BY id`;
}

Deno.test("relay isolation: a receiver that never answers delays only its own rows", async (t) => {
  const db = await createTestDatabase();
  await addTenant(db, "tenant-c");
  const reset = () => db.sql`TRUNCATE summaries, outbox, job_outcomes`;

  /** 40 webhooks of tenant C to a receiver that never answers, then tenant D's emails, timed from outside. */
  const scenario = async (options: Partial<RelayOptions>) => {
    await reset();
    const hanging = startHangingReceiver();
    const mail = startFakeMail();
    // RELAY_BATCH 20 (the default): at most 5 of its slots go to one destination.
    const relay = relayTo(
      { sql: db.sql, mailUrl: mail.url, webhookTimeoutMs: 2_500 },
      { leaseMs: 10_000, maxAttempts: 100, random: () => 0.5, ...options },
    );
    const stop = new AbortController();
    const running = relay.run(stop.signal);
    try {
      assert.ok((await timeEmail(db, mail, "tenant-d")) < 1_000, "before: an email goes out at once");
      await queueWebhooks(db, "tenant-c", hanging.url, 40);
      await waitFor("the hanging receiver to hold its share of the slots", () => hanging.open >= 5, 3_000);
      const during = await timeEmail(db, mail, "tenant-d");
      // Past the first sends' timeout (2.5 s): the hanging rows' retries and the rest of the 40 are going.
      await waitFor("the first wave of timeouts", async () => {
        const [r] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM outbox WHERE attempts > 0`;
        return r!.n >= 5;
      }, 6_000);
      const after = await timeEmail(db, mail, "tenant-d");
      assert.ok(during < 1_000, `tenant D's email took ${Math.round(during)} ms while C's receiver hung`);
      assert.ok(after < 1_000, `tenant D's email took ${Math.round(after)} ms after C's first timeouts`);
      assert.ok(hanging.maxOpen <= 5, `the hanging receiver held ${hanging.maxOpen} of the relay's 20 slots`);
      assert.equal(mail.requests, 3, "one request per email: nothing was sent twice");
      return { during, after };
    } finally {
      stop.abort();
      await running;
      await hanging.close();
      await mail.close();
    }
  };

  try {
    await t.step(
      "40 webhooks to a receiver that never answers do not delay another tenant's email by 1 s",
      async () => {
        await scenario({});
      },
    );

    await t.step("the share of slots alone keeps the email fast, with the destination backoff off", async () => {
      await scenario({ destinationFailures: Number.POSITIVE_INFINITY });
    });

    await t.step(
      "a fast destination may borrow slots but never the last quarter: when the mail provider hangs, webhooks go",
      async () => {
        await reset();
        // Fast for its first 10 emails, then every answer takes longer than the relay's 2 s mail timeout.
        const mail = startFakeMail((n) => ({ kind: "ok", delayMs: n <= 10 ? 0 : 3_000 }));
        const receiver = startFakeWebhookReceiver(new Map([["tenant-c", SECRET]]));
        const relay = relayTo(
          { sql: db.sql, mailUrl: mail.url },
          { leaseMs: 10_000, maxAttempts: 100, random: () => 0.5, destinationFailures: Number.POSITIVE_INFINITY },
        );
        const stop = new AbortController();
        const running = relay.run(stop.signal);
        try {
          const emails = Array.from({ length: 40 }, () => crypto.randomUUID());
          await commitResults(
            db.sql,
            emails.map((jobId) => ({ jobId, tenant: "tenant-d", summary: "S.", notify: "ops@example.com" })),
          );
          // Borrowed beyond its share of 5 while it was fast: 10 answered, then 15 of the 20 slots hang.
          await waitFor("the mail provider to hold three quarters of the slots", () => mail.requests >= 25, 3_000);
          const started = performance.now();
          const [hook] = await queueWebhooks(db, "tenant-c", `${receiver.url}/tenant-c`, 1);
          await waitFor("the webhook", () => receiver.processed.has(`summary_webhook:${hook}`), 5_000);
          const took = performance.now() - started;
          assert.ok(took < 1_000, `the webhook took ${Math.round(took)} ms while the mail provider hung`);
          assert.equal(mail.requests, 25, "the mail provider never held the last quarter of the slots");
        } finally {
          stop.abort();
          await running;
          await receiver.close();
          await mail.close();
        }
      },
    );

    await t.step(
      "repeated timeouts back the destination off, logged once; its rows keep their attempts and are not failed",
      async () => {
        await reset();
        const hanging = startHangingReceiver();
        const mail = startFakeMail();
        const logged = recordingLogger();
        const relay = relayTo({
          sql: db.sql,
          mailUrl: mail.url,
          webhookTimeoutMs: 400,
          log: createLogger({ level: "info", write: logged.write }),
        }, {
          leaseMs: 5_000,
          maxAttempts: 3,
          backoffBaseMs: 1,
          backoffCapMs: 5,
          destinationShare: 4,
          destinationFailures: 3,
          destinationBackoffBaseMs: 60_000,
        });
        const stop = new AbortController();
        const running = relay.run(stop.signal);
        try {
          const ids = await queueWebhooks(db, "tenant-c", hanging.url, 12);
          await waitFor("the backoff", () => logged.lines.some((l) => l.event === "relay_destination_backoff"), 5_000);
          const backoffs = () => logged.lines.filter((l) => l.event === "relay_destination_backoff");
          assert.deepEqual(
            backoffs().map((l) => [l.host, l.ms]),
            [[hanging.host, 60_000]],
            "logged once, with the host and the wait",
          );
          // Nothing more goes to the host while it is backed off, though its rows' own backoff is 5 ms at most
          // and RELAY_MAX_ATTEMPTS is 3: without the destination backoff they would all be failed by now.
          const tried = hanging.accepted;
          assert.ok(tried <= 4, `${tried} sends went out before the backoff: one share`);
          await new Promise((r) => setTimeout(r, 1_500));
          assert.equal(hanging.accepted, tried, "no send to a backed-off destination");
          assert.equal(backoffs().length, 1);
          const rows = await outboxOf(db, ids);
          assert.equal(rows.length, 12);
          for (const row of rows) {
            assert.equal(row.sent, false);
            assert.equal(row.failed, false, "the backoff fails no row");
            assert.ok(row.wait_s > 50, `deferred with the destination (next attempt in ${row.wait_s} s)`);
          }
          assert.equal(rows.filter((r) => r.attempts === 1).length, tried, "the rows that were sent spent one attempt");
          assert.equal(rows.filter((r) => r.attempts === 0).length, 12 - tried, "the deferred rows spent none");
          // The relay as a whole keeps sending.
          assert.ok((await timeEmail(db, mail, "tenant-d")) < 1_000);
        } finally {
          stop.abort();
          await running;
          await hanging.close();
          await mail.close();
        }
      },
    );

    await t.step("the backoff grows while the destination keeps hanging, and a success resets it", async () => {
      await reset();
      let hang = true;
      const held: Deno.Conn[] = [];
      const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
      const host = `127.0.0.1:${listener.addr.port}`;
      const answered = startFakeWebhookReceiver(new Map([["tenant-c", SECRET]]));
      // One host that hangs while `hang` is set, and otherwise forwards to a receiver that answers 204.
      const serving = (async () => {
        for await (const conn of listener) {
          if (hang) {
            held.push(conn);
            continue;
          }
          const target = await Deno.connect({ hostname: "127.0.0.1", port: Number(new URL(answered.url).port) });
          await Promise.all([conn.readable.pipeTo(target.writable), target.readable.pipeTo(conn.writable)])
            .catch(() => {});
        }
      })().catch(() => {});
      const logged = recordingLogger();
      const relay = relayTo({
        sql: db.sql,
        webhookTimeoutMs: 200,
        log: createLogger({ level: "info", write: logged.write }),
      }, {
        leaseMs: 3_000,
        maxAttempts: 100,
        backoffBaseMs: 1,
        backoffCapMs: 5,
        pollMs: 50,
        destinationShare: 1,
        destinationFailures: 2,
        destinationBackoffBaseMs: 300,
        destinationBackoffCapMs: 1_000,
      });
      const stop = new AbortController();
      const running = relay.run(stop.signal);
      const waits = () => logged.lines.filter((l) => l.event === "relay_destination_backoff").map((l) => l.ms);
      try {
        const ids = await queueWebhooks(db, "tenant-c", `http://${host}/hooks/tenant-c`, 1);
        await waitFor("three backoffs", () => waits().length >= 3, 8_000);
        assert.deepEqual(waits().slice(0, 4), [300, 600, 1_000, 1_000].slice(0, waits().length), "doubling, capped");
        hang = false;
        await waitFor("the delivery", async () => (await outboxOf(db, ids))[0]!.sent, 5_000);
        assert.equal(answered.processed.size, 1);
        // After the success, two failures in a row are needed again before the next backoff, which starts over.
        hang = true;
        const before = waits().length;
        const more = await queueWebhooks(db, "tenant-c", `http://${host}/hooks/tenant-c`, 1);
        await waitFor("a backoff after the success", () => waits().length > before, 5_000);
        assert.equal(waits()[before], 300, "the backoff starts over after a success");
        assert.equal((await outboxOf(db, more))[0]!.attempts, 2, "two failures, not one, after the reset");
      } finally {
        stop.abort();
        await running;
        listener.close();
        for (const conn of held) conn.close();
        await serving;
        await answered.close();
      }
    });

    await t.step(
      "600 webhooks to a slow but healthy receiver do not hide another tenant's email; alone, they borrow slots",
      async () => {
        await reset();
        const slow = startSlowReceiver(1_500);
        const mail = startFakeMail();
        const relay = relayTo(
          { sql: db.sql, mailUrl: mail.url, webhookTimeoutMs: 5_000 },
          { leaseMs: 20_000, maxAttempts: 100, random: () => 0.5 },
        );
        const stop = new AbortController();
        const running = relay.run(stop.signal);
        try {
          // More due rows of one destination than a claim used to look at (500), all ahead of D's email.
          await queueWebhooks(db, "tenant-c", slow.url, 600);
          await waitFor("the slow receiver's first answers", () => slow.answered >= 5, 5_000);
          const took = await timeEmail(db, mail, "tenant-d");
          assert.ok(took < 1_000, `tenant D's email took ${Math.round(took)} ms behind 600 slow webhooks`);
          // Slow (1.5 s) but healthy, and alone again: its destination and its tenant may use all slots but
          // the last quarter, not just their quarter.
          await waitFor("the slow receiver to hold three quarters of the slots", () => slow.open >= 15, 5_000);
          assert.ok(slow.maxOpen <= 15, `the slow receiver held ${slow.maxOpen} of the relay's 20 slots`);
          assert.equal(mail.requests, 1);
        } finally {
          stop.abort();
          await running;
          await slow.close();
          await mail.close();
        }
      },
    );

    await t.step("600 due rows of a backed-off destination do not hide another tenant's email", async () => {
      await reset();
      const hanging = startHangingReceiver();
      const mail = startFakeMail();
      const logged = recordingLogger();
      const relay = relayTo({
        sql: db.sql,
        mailUrl: mail.url,
        webhookTimeoutMs: 300,
        log: createLogger({ level: "info", write: logged.write }),
      }, { leaseMs: 5_000, maxAttempts: 100, destinationFailures: 3, destinationBackoffBaseMs: 60_000 });
      const stop = new AbortController();
      const running = relay.run(stop.signal);
      try {
        await queueWebhooks(db, "tenant-c", hanging.url, 5);
        await waitFor("the backoff", () => logged.lines.some((l) => l.event === "relay_destination_backoff"), 5_000);
        const tried = hanging.accepted;
        // Committed after the backoff moved the destination's rows: due now, but this relay claims none of them.
        await queueWebhooks(db, "tenant-c", hanging.url, 600);
        const took = await timeEmail(db, mail, "tenant-d");
        assert.ok(took < 1_000, `tenant D's email took ${Math.round(took)} ms behind 600 backed-off rows`);
        assert.equal(hanging.accepted, tried, "no send to the backed-off destination");
      } finally {
        stop.abort();
        await running;
        await hanging.close();
        await mail.close();
      }
    });

    await t.step(
      "one tenant's webhooks to 8 hosts hold at most a quarter of the slots together; another tenant's email goes",
      async () => {
        await reset();
        const tenantC: OpenCount = { open: 0, maxOpen: 0 };
        const receivers = Array.from({ length: 8 }, () => startHangingReceiver(tenantC));
        const mail = startFakeMail();
        const relay = relayTo(
          { sql: db.sql, mailUrl: mail.url, webhookTimeoutMs: 5_000 },
          { leaseMs: 15_000, maxAttempts: 100, destinationFailures: Number.POSITIVE_INFINITY },
        );
        const stop = new AbortController();
        const running = relay.run(stop.signal);
        try {
          // Ten webhooks to each of 8 host spellings (here, ports) of receivers that never answer.
          for (let i = 0; i < 10; i++) {
            for (const receiver of receivers) await queueWebhooks(db, "tenant-c", receiver.url, 1);
          }
          await waitFor("tenant C to hold its share of the slots", () => tenantC.open >= 5, 3_000);
          // Give the relay every chance to start more of C's sends (it claims as soon as a slot is free).
          await new Promise((r) => setTimeout(r, 300));
          const took = await timeEmail(db, mail, "tenant-d");
          assert.ok(took < 1_000, `tenant D's email took ${Math.round(took)} ms while C's 8 hosts hung`);
          assert.ok(tenantC.maxOpen <= 5, `tenant C's 8 hosts held ${tenantC.maxOpen} of the relay's 20 slots`);
        } finally {
          stop.abort();
          await running;
          await Promise.all(receivers.map((r) => r.close()));
          await mail.close();
        }
      },
    );

    await t.step(
      "a slow but healthy mail provider, the only destination with due rows, borrows up to three quarters of the slots",
      async () => {
        await reset();
        // Every answer takes 1.2 s: slow (over 1 s on average), never failing.
        const mail = startFakeMail(() => ({ kind: "ok", delayMs: 1_200 }));
        const relay = relayTo({ sql: db.sql, mailUrl: mail.url }, { leaseMs: 10_000, maxAttempts: 100 });
        const stop = new AbortController();
        const running = relay.run(stop.signal);
        let most = 0;
        const inFlight = () => {
          most = Math.max(most, mail.requests - mail.delivered.length);
          return mail.requests - mail.delivered.length;
        };
        try {
          // Two tenants' emails: a tenant's share caps only the destinations it chose (webhooks), not the provider.
          const jobs = Array.from({ length: 80 }, (_, i) => ({
            jobId: crypto.randomUUID(),
            tenant: i % 2 ? "tenant-d" : "tenant-e",
            summary: "S.",
            notify: "ops@example.com",
          }));
          await commitResults(db.sql, jobs);
          await waitFor("the first answers", () => mail.delivered.length >= 5, 3_000);
          await waitFor("the provider to hold three quarters of the slots", () => inFlight() >= 15, 3_000);
          // Keep watching for a while: it never takes the last quarter.
          const until = performance.now() + 1_500;
          await waitFor("a while of sending", () => {
            inFlight();
            return performance.now() > until;
          }, 3_000);
          assert.ok(most <= 15, `the mail provider held ${most} of the relay's 20 slots`);
          assert.equal(mail.deduplicated, 0, "nothing was sent twice");
        } finally {
          stop.abort();
          await running;
          await mail.close();
        }
      },
    );
  } finally {
    await db.close();
  }
});
