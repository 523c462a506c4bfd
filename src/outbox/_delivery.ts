/**
 * A relay's sending: admits claimed rows (rate-limit deferrals, destination
 * backoff, loading what they reference), sends each outside any transaction,
 * and records each outcome when its own send ends: sent, retried with
 * backoff, or failed for good. Private to the relay.
 */
import type { Sql } from "postgres";
import { createBatcher } from "../async/batcher.ts";
import { sleep } from "../async/timeout.ts";
import type { Logger } from "../log/logger.ts";
import { type Mailer, PermanentMailError } from "../mail/mailer.ts";
import { isRetryable, reasonOf } from "../retry/classify.ts";
import { backoffMs } from "../retry/retry_policy.ts";
import { contextFrom, inSpan } from "../tracing.ts";
import * as outbox from "./outbox_store.ts";
import type { ClaimedRow } from "./outbox_store.ts";
import type { SendStats } from "./_send_stats.ts";
import type { Deferral, LeasedRow, OutboxSender, PayloadLoader, RelayEvents, Renderer } from "./_relay_types.ts";

/** What a relay's delivery needs: its clients, its hooks, and its memory of sends. */
export interface DeliveryDeps {
  sql: Sql;
  mailer: Mailer;
  render: Renderer;
  senders: Record<string, OutboxSender>;
  load?: PayloadLoader;
  defer?: Deferral;
  log: Logger;
  events: RelayEvents;
  stats: SendStats;
  /** Aborted when the relay's shutdown grace runs out: sends in flight are cut off. */
  stopping: AbortSignal;
}

/** The numbers {@linkcode createDelivery} works with, resolved from the relay's options and tuning. */
export interface DeliverySettings {
  maxAttempts: number;
  backoffBaseMs: number;
  backoffCapMs: number;
  random: () => number;
  /** The most characters of an error kept in `last_error`. */
  lastErrorMaxChars: number;
  /** The most rows one mark-sent statement covers. */
  markSentMaxBatch: number;
  /** A failed mark's first wait before it is written again (full jitter), doubling per try up to the cap. */
  markRetryBaseMs: number;
  markRetryCapMs: number;
  /** How much of the lease must be left after a wait for the mark to be tried again. */
  markLeaseMarginMs: number;
  /** The relay's monotonic clock, in ms: the clock of each row's `leaseEndsMs`. */
  now: () => number;
}

/** A relay's sending. */
export interface Delivery {
  /** Applies the rate-limit deferral and destination backoff to claimed rows, then loads what the rest need. */
  admit(claimed: LeasedRow[]): Promise<LeasedRow[]>;
  /**
   * Sends one admitted row and records its outcome. Never throws. `answered` is called once the provider has
   * accepted the row, before it is marked sent (the mark is a write of ours, not a send, tried again within the
   * row's lease when it fails).
   */
  send(row: LeasedRow, answered?: () => void): Promise<void>;
}

/** Creates a relay's sending. */
export function createDelivery(deps: DeliveryDeps, settings: DeliverySettings): Delivery {
  const { sql, mailer, render, senders, load, defer, log, events, stats, stopping } = deps;
  const recordingFailures = new Set<Promise<void>>();

  async function admit(claimed: LeasedRow[]): Promise<LeasedRow[]> {
    if (claimed.length === 0) return [];
    const waits = defer ? await defer(claimed) : new Map<string, number>();
    const deferred = waits.size;
    for (const row of claimed) {
      // A destination backed off since the claim looked (the claim itself skips those it knows of).
      const wait = stats.backedOffFor(row.destination);
      if (wait > 0 && !waits.has(row.id)) waits.set(row.id, wait);
    }
    await outbox.releaseRows(sql, claimed.filter((r) => waits.has(r.id)), waits);
    if (deferred > 0) log.info("outbox_deferred", { rows: deferred });
    const rows = claimed.filter((r) => !waits.has(r.id));
    if (rows.length > 0) await load?.(rows);
    return rows;
  }

  /**
   * Makes a backed-off destination's due rows wait (next_attempt_at, no attempt spent), for other relays
   * too, and says so once. Only sends that failed spend attempts.
   */
  async function backOff(destination: string, ms: number, error: unknown): Promise<void> {
    let deferred: number | undefined;
    try {
      deferred = await outbox.postponeDestination(sql, destination, ms);
    } catch (e) {
      log.error("relay_destination_backoff_write_failed", { host: destination, error: e });
    }
    const failures = stats.failuresOf(destination);
    log.warn("relay_destination_backoff", { host: destination, ms, failures, reason: reasonOf(error), deferred });
  }

  async function recordFailure(row: ClaimedRow, error: unknown): Promise<void> {
    const attempts = row.attempts + 1;
    const permanent = error instanceof PermanentMailError || !isRetryable(error);
    const reason = reasonOf(error);
    const message = `${reason}: ${error instanceof Error ? error.message : String(error)}`.slice(
      0,
      settings.lastErrorMaxChars,
    );
    const fields = {
      outbox_id: row.id,
      job_id: row.payload.job_id,
      dedupe_key: row.dedupe_key,
      attempt: attempts,
      reason,
    };
    if (permanent || attempts >= settings.maxAttempts) {
      // Needs a person: `deno task outbox list --failed`, then `outbox retry`.
      await outbox.markFailed(sql, row, { attempts, error: message });
      events.failed?.(row, reason);
      log.warn("outbox_failed", { ...fields, permanent });
      return;
    }
    // The shared policy: full jitter, or the provider's Retry-After when it sent one (capped); and not before
    // its destination's backoff ends.
    const { backoffBaseMs: baseMs, backoffCapMs: capMs, random } = settings;
    const waitMs = Math.max(
      Math.round(backoffMs(attempts - 1, error, { baseMs, capMs, random, epochNow: Date.now() })),
      stats.backedOffFor(row.destination),
    );
    await outbox.scheduleRetry(sql, row, { attempts, error: message, waitMs });
    events.retry?.(row, reason);
    log.info("outbox_send_retry", { ...fields, wait_ms: waitMs });
  }

  // Marking sent needs no token: once the provider accepted it, it is sent, whoever holds the lease.
  // Sends that end while a mark is being written share the next statement; none waits for another send.
  const markSent = createBatcher<{ id: string; providerId: string }>(async (items) => {
    await outbox.markSent(sql, items);
    return items.map(() => undefined);
  }, { maxBatch: settings.markSentMaxBatch });

  /**
   * Marks a row the provider accepted as sent. A row left unmarked is sent again once its lease runs out, and
   * a webhook receiver, unlike the mail provider, may not dedupe that second POST: so a failed mark (a Postgres
   * blip) is written again, with backoff, while the lease leaves room. Only when the next try could not end a
   * margin before the lease does is it given up, and the row left to the lease (the duplicate window).
   */
  async function recordSent(row: LeasedRow, providerId: string): Promise<void> {
    for (let tries = 1;; tries++) {
      try {
        return await markSent({ id: row.id, providerId });
      } catch (error) {
        const { markRetryBaseMs: baseMs, markRetryCapMs: capMs, random } = settings;
        const waitMs = Math.round(random() * Math.min(capMs, baseMs * 2 ** (tries - 1)));
        const leftMs = Math.round(row.leaseEndsMs - settings.now());
        const fields = { outbox_id: row.id, tries, lease_left_ms: leftMs, error };
        if (stopping.aborted || leftMs - waitMs < settings.markLeaseMarginMs) {
          return log.error("outbox_record_failed", { ...fields, gave_up: true });
        }
        log.warn("outbox_mark_retry", { ...fields, wait_ms: waitMs });
        try {
          await sleep(waitMs, stopping);
        } catch {
          return log.error("outbox_record_failed", { ...fields, gave_up: true });
        }
      }
    }
  }

  async function send(row: LeasedRow, answered?: () => void): Promise<void> {
    const started = performance.now();
    let providerId: string | undefined;
    try {
      const sender = senders[row.topic];
      // The send joins the job's trace: the outbox row carries the committing delivery's context.
      const traceparent = typeof row.payload.traceparent === "string" ? row.payload.traceparent : undefined;
      const result = await inSpan(
        "outbox.send",
        { "outbox.id": row.id, "outbox.topic": row.topic, "job.id": String(row.payload.job_id ?? "") },
        () => sender ? sender(row, stopping) : mailer.send(render(row.topic, row.payload), row.dedupe_key, stopping),
        contextFrom(traceparent),
      );
      providerId = result.providerId;
    } catch (error) {
      // Cut off by our own shutdown: not the receiver's failure. The row keeps its lease and is sent again
      // when the lease runs out, by this relay's successor or another one.
      if (stopping.aborted) return;
      stats.timeSend(row, started);
      const backoff = stats.countFailure(row, error);
      const recorded = recordFailure(row, error)
        .catch((e) => log.error("outbox_record_failed", { outbox_id: row.id, error: e }))
        .finally(() => recordingFailures.delete(recorded));
      recordingFailures.add(recorded);
      await recorded;
      if (backoff !== undefined) {
        // Failures recorded just before the backoff began may still be in flight, their rows leased: wait for
        // them, so that the backoff also moves those rows.
        await Promise.all(recordingFailures);
        await backOff(row.destination, backoff, error);
      }
      return;
    }
    // A success (from a send begun before a backoff, if one is on) ends the destination's backoff.
    stats.timeSend(row, started);
    stats.succeeded(row);
    events.sent?.(row, performance.now() - started);
    answered?.();
    await recordSent(row, providerId ?? "");
  }

  return { admit, send };
}
