import type { Sql } from "postgres";
import { sleep } from "../async/timeout.ts";
import type { Logger } from "../log/logger.ts";
import type { Email, Mailer } from "../mail/mailer.ts";
import { PermanentMailError } from "../mail/mailer.ts";
import { isRetryable, reasonOf } from "../retry/classify.ts";
import { backoffMs } from "../retry/retry_policy.ts";
import { DEAD_LETTER_BOUNDS } from "../queue/dead_letter.ts";
import { JOB_RECORD_TTL_S } from "../summaries/keys.ts";
import { contextFrom, inSpan } from "../tracing.ts";

/** An outbox row claimed by this relay. */
export interface OutboxRow {
  id: string;
  topic: string;
  dedupe_key: string;
  payload: Record<string, unknown>;
  attempts: number;
  claim_token: string;
}

/** Turns an outbox row into the email to send. @throws for a topic it does not know (a permanent failure). */
export type Renderer = (topic: string, payload: Record<string, unknown>) => Email;

/**
 * Delivers a row of a topic that is not an email (a webhook). Throws like a
 * mailer: a retryable error is retried with backoff, anything else fails the
 * row. The row's dedupe key is its idempotency key at the receiver.
 */
export type OutboxSender = (row: OutboxRow, signal: AbortSignal) => Promise<{ providerId?: string }>;

/**
 * Completes claimed rows' payloads with what the renderer needs and the row
 * only references (one query for the whole batch), before any is rendered.
 */
export type PayloadLoader = (rows: OutboxRow[]) => Promise<void>;

/**
 * Decides which claimed rows must wait (a rate limit): returns each such
 * row's id with how long it waits. A deferred row is released without
 * counting an attempt.
 */
export type Deferral = (rows: OutboxRow[]) => Promise<Map<string, number>>;

/** Counters a relay reports; wire them to metrics. */
export interface RelayEvents {
  sent?(row: OutboxRow, durationMs: number): void;
  retry?(row: OutboxRow, reason: string): void;
  failed?(row: OutboxRow, reason: string): void;
}

/** Options for {@linkcode createRelay}. */
export interface RelayOptions {
  /** Rows per claim (RELAY_BATCH); their sends run concurrently. */
  batch: number;
  /** Attempts before a row is marked failed (RELAY_MAX_ATTEMPTS). */
  maxAttempts: number;
  /** How long a claim is held; an expired lease makes the row claimable again. Above the send timeout. */
  leaseMs: number;
  /** Slow poll for rows that become due through backoff or expired leases. */
  pollMs?: number;
  backoffBaseMs?: number;
  backoffCapMs?: number;
  /** Sent rows older than this are deleted. */
  retentionMs?: number;
  /** SUMMARY_RETENTION_S in ms: summaries older than this are deleted; unset, they are kept. */
  summaryRetentionMs?: number;
  /** MODEL_ATTEMPTS_RETENTION_S in ms: the record of model attempts older than this is deleted. */
  attemptRetentionMs?: number;
  /** How often retention runs. */
  retentionEveryMs?: number;
  random?: () => number;
  events?: RelayEvents;
}

/** A running relay. */
export interface Relay {
  /** Claims due rows, sends them concurrently, records the outcomes. @returns how many rows were claimed. */
  runOnce(): Promise<number>;
  /** Claims up to `batch` due rows under a lease (exposed for crash tests). */
  claim(): Promise<OutboxRow[]>;
  /** Sends claimed rows and records each outcome (exposed for crash tests). */
  deliver(rows: OutboxRow[]): Promise<void>;
  /** Loops until `signal` aborts: wakes on NOTIFY, falls back to a slow poll, and finishes the current batch. */
  run(signal: AbortSignal): Promise<void>;
  /** Deletes sent rows older than the retention age, in small batches. @returns rows deleted. */
  purgeSent(): Promise<number>;
}

/** The NOTIFY channel a trigger on outbox inserts signals (see migrations). */
export const OUTBOX_CHANNEL = "oncely_outbox";
const PURGE_BATCH = 1_000;
/** How long a stopping relay lets its current batch run before aborting its sends (the process exits within 10 s). */
const SHUTDOWN_GRACE_MS = 5_000;
/**
 * A job's outcome row is kept at least as long as anything may still ask about the job, plus a day: its
 * Redis status record and its dead letters (both 7 days). A dead letter's replay reads it to refuse a job
 * that already had its effects, and a job is decided (failed) before it is dead-lettered, so its outcome
 * always outlives its dead letters.
 */
const OUTCOME_MIN_AGE_MS = (Math.max(JOB_RECORD_TTL_S, DEAD_LETTER_BOUNDS.maxAgeS) + 24 * 3600) * 1000;

/**
 * Creates the outbox relay. No transaction is held across a network call:
 * a claim stamps `locked_until` and a token in one short statement, the send
 * happens outside any transaction, and a second short statement records the
 * outcome. `FOR UPDATE SKIP LOCKED` keeps concurrent relays off each other's
 * rows. A crash after the provider accepted a send but before we recorded it
 * is the one duplicate window; the row's dedupe key, passed to the provider
 * as its Idempotency-Key, closes it.
 */
export function createRelay(
  { sql, mailer, render, senders = {}, load, defer, log }: {
    sql: Sql;
    mailer: Mailer;
    render: Renderer;
    /** Senders by topic for rows that are not emails; every other topic goes through `render` and `mailer`. */
    senders?: Record<string, OutboxSender>;
    load?: PayloadLoader;
    defer?: Deferral;
    log: Logger;
  },
  options: RelayOptions,
): Relay {
  const random = options.random ?? Math.random;
  const baseMs = options.backoffBaseMs ?? 2_000;
  const capMs = options.backoffCapMs ?? 600_000;
  const pollMs = options.pollMs ?? 2_000;
  const retentionMs = options.retentionMs ?? 7 * 24 * 3600 * 1000;
  const events = options.events ?? {};
  const stopping = new AbortController();

  async function claim(): Promise<OutboxRow[]> {
    const token = crypto.randomUUID();
    return await sql<OutboxRow[]>`
      UPDATE outbox SET locked_until = now() + ${options.leaseMs} * interval '1 millisecond', claim_token = ${token}
      WHERE id IN (
        SELECT id FROM outbox
        WHERE sent_at IS NULL AND failed_at IS NULL AND next_attempt_at <= now()
          AND (locked_until IS NULL OR locked_until < now())
        ORDER BY next_attempt_at, id
        LIMIT ${options.batch}
        FOR UPDATE SKIP LOCKED
      )
      RETURNING id::text, topic, dedupe_key, payload, attempts, claim_token::text`;
  }

  async function recordFailure(row: OutboxRow, error: unknown): Promise<void> {
    const attempts = row.attempts + 1;
    const permanent = error instanceof PermanentMailError || !isRetryable(error);
    const reason = reasonOf(error);
    const message = `${reason}: ${error instanceof Error ? error.message : String(error)}`.slice(0, 1000);
    const fields = {
      outbox_id: row.id,
      job_id: row.payload.job_id,
      dedupe_key: row.dedupe_key,
      attempt: attempts,
      reason,
    };
    if (permanent || attempts >= options.maxAttempts) {
      // Needs a person: `deno task outbox list --failed`, then `outbox retry`.
      await sql`
        UPDATE outbox SET attempts = ${attempts}, last_error = ${message}, failed_at = now(), locked_until = NULL
        WHERE id = ${row.id} AND claim_token = ${row.claim_token} AND sent_at IS NULL`;
      events.failed?.(row, reason);
      log.warn("outbox_failed", { ...fields, permanent });
      return;
    }
    // The shared policy: full jitter, or the provider's Retry-After when it sent one (capped).
    const waitMs = Math.round(backoffMs(attempts - 1, error, { baseMs, capMs, random, epochNow: Date.now() }));
    await sql`
      UPDATE outbox SET attempts = ${attempts}, last_error = ${message}, locked_until = NULL,
        next_attempt_at = now() + ${waitMs} * interval '1 millisecond'
      WHERE id = ${row.id} AND claim_token = ${row.claim_token} AND sent_at IS NULL`;
    events.retry?.(row, reason);
    log.info("outbox_send_retry", { ...fields, wait_ms: waitMs });
  }

  async function deliver(claimed: OutboxRow[]): Promise<void> {
    const waits = defer ? await defer(claimed) : new Map<string, number>();
    if (waits.size > 0) {
      for (const [id, ms] of waits) {
        const row = claimed.find((r) => r.id === id)!;
        await sql`
          UPDATE outbox SET locked_until = NULL, next_attempt_at = now() + ${Math.round(ms)} * interval '1 millisecond'
          WHERE id = ${id} AND claim_token = ${row.claim_token} AND sent_at IS NULL`;
      }
      log.info("outbox_deferred", { rows: waits.size });
    }
    const rows = claimed.filter((r) => !waits.has(r.id));
    await load?.(rows);
    const sent: string[] = [];
    const providerIds: string[] = [];
    await Promise.all(rows.map(async (row) => {
      const started = performance.now();
      try {
        const sender = senders[row.topic];
        // The send joins the job's trace: the outbox row carries the committing delivery's context.
        const traceparent = typeof row.payload.traceparent === "string" ? row.payload.traceparent : undefined;
        const result = await inSpan(
          "outbox.send",
          { "outbox.id": row.id, "outbox.topic": row.topic, "job.id": String(row.payload.job_id ?? "") },
          () =>
            sender
              ? sender(row, stopping.signal)
              : mailer.send(render(row.topic, row.payload), row.dedupe_key, stopping.signal),
          contextFrom(traceparent),
        );
        sent.push(row.id);
        providerIds.push(result.providerId ?? "");
        events.sent?.(row, performance.now() - started);
      } catch (error) {
        // Cut off by our own shutdown: not the receiver's failure. The row keeps its lease and is sent again
        // when the lease runs out, by this relay's successor or another one.
        if (stopping.signal.aborted) return;
        await recordFailure(row, error).catch((e) =>
          log.error("outbox_record_failed", { outbox_id: row.id, error: e })
        );
      }
    }));
    if (sent.length === 0) return;
    // Marking sent needs no token: once the provider accepted it, it is sent, whoever holds the lease.
    await sql`
      UPDATE outbox SET sent_at = now(), locked_until = NULL, last_error = NULL,
        provider_message_id = NULLIF(p.provider_id, '')
      FROM unnest(${sent}::bigint[], ${providerIds}::text[]) AS p(id, provider_id)
      WHERE outbox.id = p.id AND outbox.sent_at IS NULL`;
  }

  async function runOnce(): Promise<number> {
    const rows = await claim();
    if (rows.length > 0) await deliver(rows);
    return rows.length;
  }

  async function purgeSent(): Promise<number> {
    let total = 0;
    for (;;) {
      const deleted = await sql`
        DELETE FROM outbox WHERE id IN (
          SELECT id FROM outbox WHERE sent_at < now() - ${retentionMs} * interval '1 millisecond' LIMIT ${PURGE_BATCH}
        )`;
      total += deleted.count;
      if (deleted.count < PURGE_BATCH) break;
    }
    if (options.attemptRetentionMs !== undefined) total += await purgeAttempts(options.attemptRetentionMs);
    if (options.summaryRetentionMs === undefined) return total;
    for (;;) {
      // Summaries whose notification is still unsent stay: the email needs them.
      // The job's outcome row stays longer (below): it keeps a finished job finished, so a late DELETE
      // still gets 409 and a replayed message still skips the model, after the summary is gone.
      const deleted = await sql`
        DELETE FROM summaries WHERE job_id IN (
          SELECT s.job_id FROM summaries s
          WHERE s.created_at < now() - ${options.summaryRetentionMs} * interval '1 millisecond'
            AND NOT EXISTS (
              SELECT 1 FROM outbox o WHERE o.payload->>'job_id' = s.job_id::text AND o.sent_at IS NULL
            )
          LIMIT ${PURGE_BATCH}
        )`;
      total += deleted.count;
      if (deleted.count < PURGE_BATCH) break;
    }
    // Outcome rows outlive their summaries until nothing can ask about the job any more: the job's Redis
    // record (7 days) and its idempotency record (at most SUMMARY_RETENTION_S) are gone by then.
    const outcomeAgeMs = Math.max(options.summaryRetentionMs, OUTCOME_MIN_AGE_MS);
    for (;;) {
      const deleted = await sql`
        DELETE FROM job_outcomes WHERE job_id IN (
          SELECT o.job_id FROM job_outcomes o
          WHERE o.decided_at < now() - ${outcomeAgeMs} * interval '1 millisecond'
            AND NOT EXISTS (SELECT 1 FROM summaries s WHERE s.job_id = o.job_id)
          LIMIT ${PURGE_BATCH}
        )`;
      total += deleted.count;
      if (deleted.count < PURGE_BATCH) return total;
    }
  }

  async function purgeAttempts(ageMs: number): Promise<number> {
    let total = 0;
    for (;;) {
      const deleted = await sql`
        DELETE FROM model_attempts WHERE id IN (
          SELECT id FROM model_attempts WHERE started_at < now() - ${ageMs} * interval '1 millisecond'
          LIMIT ${PURGE_BATCH}
        )`;
      total += deleted.count;
      if (deleted.count < PURGE_BATCH) return total;
    }
  }

  async function run(signal: AbortSignal): Promise<void> {
    let wake: (() => void) | undefined;
    let notified = false;
    const listener = await sql.listen(OUTBOX_CHANNEL, () => {
      notified = true;
      wake?.();
    });
    // On stop, the current batch gets a grace period to finish; then its sends are aborted (their rows keep
    // the lease and go again when it runs out). The timer starts at the stop, not when the loop notices it.
    let grace: ReturnType<typeof setTimeout> | undefined;
    const onAbort = () => {
      wake?.();
      grace = setTimeout(() => stopping.abort(new Error("relay stopping")), SHUTDOWN_GRACE_MS);
    };
    signal.addEventListener("abort", onAbort);
    let nextPurge = performance.now() + 5_000;
    let current: Promise<unknown> = Promise.resolve();
    try {
      while (!signal.aborted) {
        notified = false;
        let claimed = 0;
        try {
          current = runOnce();
          claimed = await (current as Promise<number>);
          if (performance.now() >= nextPurge) {
            nextPurge = performance.now() + (options.retentionEveryMs ?? 600_000);
            const purged = await purgeSent();
            if (purged > 0) log.info("outbox_purged", { rows: purged });
          }
        } catch (error) {
          if (signal.aborted) break;
          log.warn("relay_pass_failed", { error });
          await sleep(1_000, signal).catch(() => {});
          continue;
        }
        // A full batch means more may be due: go again at once.
        if (claimed >= options.batch || notified) continue;
        await new Promise<void>((resolve) => {
          const timer = setTimeout(resolve, pollMs);
          wake = () => {
            clearTimeout(timer);
            resolve();
          };
        });
        wake = undefined;
      }
    } finally {
      signal.removeEventListener("abort", onAbort);
      await current.catch(() => {});
      clearTimeout(grace);
      await listener.unlisten();
    }
  }

  return { runOnce, claim, deliver, run, purgeSent };
}
