import type { Sql } from "postgres";
import { createBatcher } from "../async/batcher.ts";
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

/** A claimed row and where it goes, as the claim computed it (see {@linkcode MAIL_DESTINATION}). */
export interface ClaimedRow extends OutboxRow {
  /** The host (and port) of the payload's `webhook` URL, lower-cased; for every other row, the mail provider. */
  destination: string;
}

/** The destination of every row that is not a webhook: the one mail provider (no host name has a space). */
export const MAIL_DESTINATION = "mail provider";

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
 * only references (one query for the whole claim), before any is rendered.
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

/** Options for {@linkcode createRelay}; the defaults are {@linkcode RELAY_DEFAULTS}. */
export interface RelayOptions {
  /** RELAY_BATCH: the most rows per claim, and the most sends in flight at once in {@linkcode Relay.run}. */
  batch: number;
  /** Attempts before a row is marked failed (RELAY_MAX_ATTEMPTS). */
  maxAttempts: number;
  /**
   * How long a claim is held; an expired lease makes the row claimable again. Above the send timeout: a row
   * is claimed only when its send can start at once, so the lease runs from (just before) its send's start.
   */
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
  /**
   * The sends in flight that any one destination may hold in {@linkcode Relay.run}; unset, a quarter of `batch`
   * (at least 1). A destination whose recent sends were fast, and that has not failed since its last success,
   * may borrow more, up to `batch` minus one share: a share of the slots always stays for the others.
   */
  destinationShare?: number;
  /** Timeouts or connection errors in a row from one destination (no success between) before it is backed off. */
  destinationFailures?: number;
  /** A destination's first backoff; each next one (without a success between) doubles, up to the cap. */
  destinationBackoffBaseMs?: number;
  destinationBackoffCapMs?: number;
  random?: () => number;
  /** A monotonic clock in ms, for destination backoff. */
  now?: () => number;
  events?: RelayEvents;
}

/** Defaults of the optional {@linkcode RelayOptions}. */
export const RELAY_DEFAULTS = {
  pollMs: 2_000,
  backoffBaseMs: 2_000,
  backoffCapMs: 600_000,
  retentionMs: 7 * 24 * 3600 * 1000,
  retentionEveryMs: 600_000,
  destinationFailures: 3,
  destinationBackoffBaseMs: 30_000,
  destinationBackoffCapMs: 600_000,
} as const;

/** A running relay. */
export interface Relay {
  /**
   * One step, for tests and benchmarks: claims up to `batch` due rows (none of a backed-off destination),
   * sends them concurrently, records each outcome as its send ends, and resolves when all have ended.
   * It does not apply the per-destination share: that is {@linkcode Relay.run}'s, which keeps sending
   * while a slow send is in flight. @returns how many rows were claimed.
   */
  runOnce(): Promise<number>;
  /** Claims up to `batch` due rows under a lease (exposed for crash tests). */
  claim(): Promise<ClaimedRow[]>;
  /** Sends claimed rows and records each outcome (exposed for crash tests). */
  deliver(rows: ClaimedRow[]): Promise<void>;
  /**
   * Loops until `signal` aborts: keeps up to `batch` sends in flight, each destination within its share (see
   * `destinationShare`), and claims more as slots free up; wakes on NOTIFY, falls back to a slow poll; on stop,
   * lets the sends in flight finish (within the shutdown grace).
   */
  run(signal: AbortSignal): Promise<void>;
  /** Deletes sent rows older than the retention age, in small batches. @returns rows deleted. */
  purgeSent(): Promise<number>;
}

/** The NOTIFY channel a trigger on outbox inserts signals (see migrations). */
export const OUTBOX_CHANNEL = "oncely_outbox";
const PURGE_BATCH = 1_000;
/** How long a stopping relay lets its sends in flight run before aborting them (the process exits within 10 s). */
const SHUTDOWN_GRACE_MS = 5_000;
/**
 * How many due rows (in order) a claim looks at to fill its free slots within each destination's budget:
 * rows of a destination at its budget do not hide other destinations' rows up to this depth. Bounded, so
 * that a claim costs the same whatever the backlog.
 */
const CLAIM_LOOKAHEAD = 500;
/** A destination whose sends take less than this on average (and that has not failed since) may borrow slots. */
const FAST_SEND_MS = 1_000;
/** Weight of the newest send in a destination's average send time. */
const SEND_TIME_WEIGHT = 0.2;
/** Destinations whose statistics are remembered; past it, those not backed off are forgotten. */
const MAX_TRACKED_DESTINATIONS = 1_000;
/**
 * A job's outcome row is kept at least as long as anything may still ask about the job, plus a day: its
 * Redis status record and its dead letters (both 7 days). A dead letter's replay reads it to refuse a job
 * that already had its effects, and a job is decided (failed) before it is dead-lettered, so its outcome
 * always outlives its dead letters.
 */
const OUTCOME_MIN_AGE_MS = (Math.max(JOB_RECORD_TTL_S, DEAD_LETTER_BOUNDS.maxAgeS) + 24 * 3600) * 1000;

/** How many rows one claim may take: in all, per listed destination (0 excludes it), and per other destination. */
interface ClaimLimits {
  limit: number;
  budgets: Map<string, number>;
  share: number;
}

/** What the relay remembers about one destination. */
interface DestinationStats {
  /** Moving average of its sends' durations in ms, timeouts included; unset until one ended. */
  sendMs?: number;
  /** Timeouts and connection errors since its last success. */
  failures: number;
  /** Backoffs since its last success: the next one waits base × 2^backoffs. */
  backoffs: number;
  /** Until when (on the relay's clock) its rows are not sent. */
  until: number;
}

/**
 * Creates the outbox relay. No transaction is held across a network call:
 * a claim stamps `locked_until` and a token in one short statement, the send
 * happens outside any transaction, and a second short statement records the
 * outcome. `FOR UPDATE SKIP LOCKED` keeps concurrent relays off each other's
 * rows. A crash after the provider accepted a send but before we recorded it
 * is the one duplicate window; the row's dedupe key, passed to the provider
 * as its Idempotency-Key, closes it.
 *
 * Rows are sent independently: each outcome is recorded when its own send
 * ends, and {@linkcode Relay.run} claims more as slots free up, so a receiver
 * that hangs until the send timeout holds its own slots, never a batch.
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
  const now = options.now ?? (() => performance.now());
  const baseMs = options.backoffBaseMs ?? RELAY_DEFAULTS.backoffBaseMs;
  const capMs = options.backoffCapMs ?? RELAY_DEFAULTS.backoffCapMs;
  const pollMs = options.pollMs ?? RELAY_DEFAULTS.pollMs;
  const retentionMs = options.retentionMs ?? RELAY_DEFAULTS.retentionMs;
  const failuresBeforeBackoff = options.destinationFailures ?? RELAY_DEFAULTS.destinationFailures;
  const destinationBaseMs = options.destinationBackoffBaseMs ?? RELAY_DEFAULTS.destinationBackoffBaseMs;
  const destinationCapMs = options.destinationBackoffCapMs ?? RELAY_DEFAULTS.destinationBackoffCapMs;
  const share = Math.max(1, Math.floor(options.destinationShare ?? options.batch / 4));
  const events = options.events ?? {};
  const stopping = new AbortController();
  /** Slots one fast destination may use: all but one share, which stays for the others. */
  const borrowCap = Math.max(share, options.batch - share);
  const stats = new Map<string, DestinationStats>();
  const recordingFailures = new Set<Promise<void>>();

  /**
   * A row's destination, computed in SQL only (the claim returns it), so that the claim's exclusions and the
   * relay's own counts always spell a destination the same way.
   */
  const destinationOf = () =>
    sql`CASE WHEN payload ? 'webhook'
      THEN coalesce(lower(substring(payload->>'webhook' FROM '^[A-Za-z][A-Za-z0-9+.-]*://(?:[^@/?#]*@)?([^/?#]*)')), '')
      ELSE ${MAIL_DESTINATION}::text END`;

  /** How long `destination` is still backed off, in ms (0: not). */
  function backedOffFor(destination: string): number {
    const d = stats.get(destination);
    return d ? Math.max(0, Math.ceil(d.until - now())) : 0;
  }

  function statsOf(destination: string): DestinationStats {
    let d = stats.get(destination);
    if (!d) {
      if (stats.size >= MAX_TRACKED_DESTINATIONS) {
        for (const [key, old] of stats) if (old.until <= now()) stats.delete(key);
      }
      stats.set(destination, d = { failures: 0, backoffs: 0, until: 0 });
    }
    return d;
  }

  /**
   * The most sends in flight to `destination` in {@linkcode Relay.run}: its share, or, while its sends are
   * fast and have not failed since its last success, all slots but one share. A destination never seen, a
   * slow one and a failing one hold at most its share, so however it hangs, the others keep their slots.
   */
  function capOf(destination: string): number {
    const d = stats.get(destination);
    return d?.sendMs !== undefined && d.sendMs < FAST_SEND_MS && d.failures === 0 ? borrowCap : share;
  }

  /**
   * Claims due rows within `limits`, in one statement: it looks at the first due rows in order (a bounded
   * look-ahead, not locked), picks at most each destination's budget of them, and leases those it can lock
   * (SKIP LOCKED: another relay's claim in the same instant keeps what it locked).
   * @returns the rows, and whether more may be due that these limits allow (the claim was full, or another
   * relay took rows it picked).
   */
  async function claimRows({ limit, budgets, share }: ClaimLimits): Promise<{ rows: ClaimedRow[]; more: boolean }> {
    const token = crypto.randomUUID();
    const listed = [...budgets.keys()];
    const room = listed.map((destination) => budgets.get(destination)!);
    const lookahead = share >= limit && room.every((r) => r >= limit) ? limit : Math.max(limit, CLAIM_LOOKAHEAD);
    const result = await sql<(ClaimedRow & { picked: number })[]>`
      WITH ahead AS (
        SELECT id, next_attempt_at, ${destinationOf()} AS destination FROM outbox
        WHERE sent_at IS NULL AND failed_at IS NULL AND next_attempt_at <= now()
          AND (locked_until IS NULL OR locked_until < now())
        ORDER BY next_attempt_at, id
        LIMIT ${lookahead}
      ), picked AS (
        SELECT id, destination FROM (
          SELECT a.id, a.next_attempt_at, a.destination,
            row_number() OVER (PARTITION BY a.destination ORDER BY a.next_attempt_at, a.id) AS n,
            coalesce(b.budget, ${share}::int) AS budget
          FROM ahead a
          LEFT JOIN unnest(${listed}::text[], ${room}::int[]) AS b(destination, budget) USING (destination)
        ) ranked
        WHERE n <= budget
        ORDER BY next_attempt_at, id
        LIMIT ${limit}
      ), locked AS (
        -- The guard is checked again under the lock, on the row's newest version: a row another relay claimed
        -- since the look-ahead read it is not ours. (coalesce(...) IS NULL is sent_at IS NULL AND failed_at IS
        -- NULL spelled so that the planner looks the picked ids up by primary key, not through the due index.)
        SELECT id FROM outbox
        WHERE id = ANY(ARRAY(SELECT id FROM picked)) AND coalesce(sent_at, failed_at) IS NULL
          AND (locked_until IS NULL OR locked_until < now())
        FOR UPDATE SKIP LOCKED
      ), claimed AS (
        UPDATE outbox SET locked_until = now() + ${options.leaseMs} * interval '1 millisecond',
          claim_token = ${token}
        FROM picked WHERE outbox.id = ANY(ARRAY(SELECT id FROM locked)) AND picked.id = outbox.id
        RETURNING outbox.id::text, topic, dedupe_key, payload, attempts, claim_token::text, picked.destination
      )
      SELECT c.*, (SELECT count(*) FROM picked)::int AS picked FROM (VALUES (1)) AS one LEFT JOIN claimed c ON true`;
    const picked = result[0]?.picked ?? 0;
    const rows: ClaimedRow[] = [];
    for (const { picked: _, ...row } of result) if (row.id !== null) rows.push(row);
    return { rows, more: rows.length >= limit || rows.length < picked };
  }

  async function claim(): Promise<ClaimedRow[]> {
    const { rows } = await claimRows({
      limit: options.batch,
      budgets: new Map(backedOff().map((destination) => [destination, 0])),
      share: options.batch,
    });
    return rows;
  }

  function backedOff(): string[] {
    const t = now();
    return [...stats].filter(([, d]) => d.until > t).map(([destination]) => destination);
  }

  /** Releases claimed rows without spending an attempt: each becomes due again after its wait. */
  async function release(rows: ClaimedRow[], waits: Map<string, number>): Promise<void> {
    if (rows.length === 0) return;
    // The token guard: a row whose lease ran out and that another relay claimed since is not ours to move.
    await sql`
      UPDATE outbox SET locked_until = NULL, next_attempt_at = now() + w.ms * interval '1 millisecond'
      FROM unnest(${rows.map((r) => r.id)}::bigint[], ${rows.map((r) => r.claim_token)}::uuid[],
        ${rows.map((r) => Math.round(waits.get(r.id)!))}::float8[]) AS w(id, token, ms)
      WHERE outbox.id = w.id AND outbox.claim_token = w.token AND outbox.sent_at IS NULL`;
  }

  /** Applies the rate-limit deferral and destination backoff to claimed rows, then loads what the rest need. */
  async function admit(claimed: ClaimedRow[]): Promise<ClaimedRow[]> {
    if (claimed.length === 0) return [];
    const waits = defer ? await defer(claimed) : new Map<string, number>();
    const deferred = waits.size;
    for (const row of claimed) {
      // A destination backed off since the claim looked (the claim itself skips those it knows of).
      const wait = backedOffFor(row.destination);
      if (wait > 0 && !waits.has(row.id)) waits.set(row.id, wait);
    }
    await release(claimed.filter((r) => waits.has(r.id)), waits);
    if (deferred > 0) log.info("outbox_deferred", { rows: deferred });
    const rows = claimed.filter((r) => !waits.has(r.id));
    if (rows.length > 0) await load?.(rows);
    return rows;
  }

  /**
   * Counts a failed send against its destination. After `destinationFailures` timeouts or connection errors
   * in a row, the destination is backed off: this relay claims none of its rows until the backoff ends, and
   * its due rows wait (next_attempt_at, no attempt spent; see {@linkcode backOff}). Only sends that failed
   * spend attempts. @returns the backoff this failure starts, in ms, if it starts one.
   */
  function countFailure(destination: string, error: unknown): number | undefined {
    const reason = reasonOf(error);
    if (reason !== "timeout" && reason !== "connection") return undefined;
    const d = statsOf(destination);
    d.failures++;
    // Sends already in flight when the backoff began only count; after it, the next failure backs off again.
    if (d.failures < failuresBeforeBackoff || d.until > now()) return undefined;
    const ms = Math.min(destinationCapMs, destinationBaseMs * 2 ** d.backoffs);
    d.backoffs++;
    d.until = now() + ms;
    return ms;
  }

  /** Makes a backed-off destination's due rows wait, for other relays too, and says so once. */
  async function backOff(destination: string, ms: number, error: unknown): Promise<void> {
    let deferred: number | undefined;
    try {
      // Rows in flight (leased) are not touched: each is recorded when its own send ends.
      const moved = await sql`
        UPDATE outbox SET next_attempt_at = now() + ${ms} * interval '1 millisecond'
        WHERE id IN (
          SELECT id FROM outbox
          WHERE sent_at IS NULL AND failed_at IS NULL AND next_attempt_at < now() + ${ms} * interval '1 millisecond'
            AND (locked_until IS NULL OR locked_until < now()) AND ${destinationOf()} = ${destination}
          FOR UPDATE SKIP LOCKED
        )`;
      deferred = moved.count;
    } catch (e) {
      log.error("relay_destination_backoff_write_failed", { host: destination, error: e });
    }
    const failures = stats.get(destination)?.failures;
    log.warn("relay_destination_backoff", { host: destination, ms, failures, reason: reasonOf(error), deferred });
  }

  async function recordFailure(row: ClaimedRow, error: unknown): Promise<void> {
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
    // The shared policy: full jitter, or the provider's Retry-After when it sent one (capped); and not before
    // its destination's backoff ends.
    const waitMs = Math.max(
      Math.round(backoffMs(attempts - 1, error, { baseMs, capMs, random, epochNow: Date.now() })),
      backedOffFor(row.destination),
    );
    await sql`
      UPDATE outbox SET attempts = ${attempts}, last_error = ${message}, locked_until = NULL,
        next_attempt_at = now() + ${waitMs} * interval '1 millisecond'
      WHERE id = ${row.id} AND claim_token = ${row.claim_token} AND sent_at IS NULL`;
    events.retry?.(row, reason);
    log.info("outbox_send_retry", { ...fields, wait_ms: waitMs });
  }

  // Marking sent needs no token: once the provider accepted it, it is sent, whoever holds the lease.
  // Sends that end while a mark is being written share the next statement; none waits for another send.
  const markSent = createBatcher<{ id: string; providerId: string }>(async (items) => {
    await sql`
      UPDATE outbox SET sent_at = now(), locked_until = NULL, last_error = NULL,
        provider_message_id = NULLIF(p.provider_id, '')
      FROM unnest(${items.map((i) => i.id)}::bigint[], ${items.map((i) => i.providerId)}::text[])
        AS p(id, provider_id)
      WHERE outbox.id = p.id AND outbox.sent_at IS NULL`;
    return items.map(() => undefined);
  }, { maxBatch: 500 });

  /** Adds a send that ended to its destination's average send time. */
  function timeSend(destination: string, started: number): DestinationStats {
    const d = statsOf(destination);
    const ms = performance.now() - started;
    d.sendMs = d.sendMs === undefined ? ms : d.sendMs + SEND_TIME_WEIGHT * (ms - d.sendMs);
    return d;
  }

  /** Sends one claimed row and records its outcome. Never throws. */
  async function send(row: ClaimedRow): Promise<void> {
    const started = performance.now();
    let providerId: string | undefined;
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
      providerId = result.providerId;
    } catch (error) {
      // Cut off by our own shutdown: not the receiver's failure. The row keeps its lease and is sent again
      // when the lease runs out, by this relay's successor or another one.
      if (stopping.signal.aborted) return;
      timeSend(row.destination, started);
      const backoff = countFailure(row.destination, error);
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
    // A success (from a send begun before a backoff, if one is on) ends the destination's backoff. Rows the
    // backoff already moved keep their wait, which is at most this backoff's.
    const d = timeSend(row.destination, started);
    d.failures = 0;
    d.backoffs = 0;
    d.until = 0;
    events.sent?.(row, performance.now() - started);
    await markSent({ id: row.id, providerId: providerId ?? "" })
      .catch((e) => log.error("outbox_record_failed", { outbox_id: row.id, error: e }));
  }

  async function deliver(claimed: ClaimedRow[]): Promise<void> {
    const rows = await admit(claimed);
    await Promise.all(rows.map(send));
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
    const sending = new Set<Promise<void>>();
    const perDestination = new Map<string, number>();
    // Rows may be due: claim as soon as a slot is free. Set by NOTIFY, the poll, a full claim, and a slot
    // freeing where rows may have waited for it.
    let scan = true;
    let wake: (() => void) | undefined;
    const nudge = () => {
      const w = wake;
      wake = undefined;
      w?.();
    };
    const listener = await sql.listen(OUTBOX_CHANNEL, () => {
      scan = true;
      nudge();
    });
    // On stop, the sends in flight get a grace period to finish; then they are aborted (their rows keep
    // the lease and go again when it runs out). The timer starts at the stop, not when the loop notices it.
    let grace: ReturnType<typeof setTimeout> | undefined;
    const onAbort = () => {
      nudge();
      grace = setTimeout(() => stopping.abort(new Error("relay stopping")), SHUTDOWN_GRACE_MS);
    };
    signal.addEventListener("abort", onAbort);

    const start = (row: ClaimedRow) => {
      const { destination } = row;
      perDestination.set(destination, (perDestination.get(destination) ?? 0) + 1);
      const done: Promise<void> = send(row).finally(() => {
        const wasFull = sending.size >= options.batch;
        sending.delete(done);
        const held = perDestination.get(destination) ?? 1;
        if (held > 1) perDestination.set(destination, held - 1);
        else perDestination.delete(destination);
        // Rows may have waited for this slot: all slots were taken, or this destination was at its share.
        if (wasFull || held >= share) scan = true;
        nudge();
      });
      sending.add(done);
    };

    /** Claims what the free slots and each destination's share allow, and starts those sends. */
    const fill = async (): Promise<boolean> => {
      const limit = options.batch - sending.size;
      const budgets = new Map<string, number>();
      for (const destination of stats.keys()) {
        if (capOf(destination) !== share) budgets.set(destination, capOf(destination));
      }
      for (const [destination, held] of perDestination) budgets.set(destination, capOf(destination) - held);
      for (const destination of backedOff()) budgets.set(destination, 0);
      // Claimed just before their sends start: each row's lease runs from its send's start.
      const { rows, more } = await claimRows({ limit, budgets, share });
      for (const row of await admit(rows)) start(row);
      return more;
    };

    let nextPoll = performance.now();
    let nextPurge = performance.now() + 5_000;
    let purging: Promise<void> | undefined;
    try {
      while (!signal.aborted) {
        if (performance.now() >= nextPoll) {
          scan = true;
          nextPoll = performance.now() + pollMs;
        }
        if (!purging && performance.now() >= nextPurge) {
          nextPurge = performance.now() + (options.retentionEveryMs ?? RELAY_DEFAULTS.retentionEveryMs);
          // Beside the sends, not in their way.
          purging = (async () => {
            try {
              const purged = await purgeSent();
              if (purged > 0) log.info("outbox_purged", { rows: purged });
            } catch (error) {
              log.warn("relay_pass_failed", { error });
            } finally {
              purging = undefined;
            }
          })();
        }
        if (scan && sending.size < options.batch) {
          scan = false;
          try {
            if (await fill()) scan = true;
          } catch (error) {
            if (signal.aborted) break;
            log.warn("relay_pass_failed", { error });
            await sleep(1_000, signal).catch(() => {});
            scan = true;
          }
          continue;
        }
        await new Promise<void>((resolve) => {
          const timer = setTimeout(resolve, Math.max(0, nextPoll - performance.now()));
          wake = () => {
            clearTimeout(timer);
            resolve();
          };
        });
        wake = undefined;
      }
    } finally {
      signal.removeEventListener("abort", onAbort);
      await Promise.all(sending);
      await purging;
      clearTimeout(grace);
      await listener.unlisten();
    }
  }

  return { runOnce, claim, deliver, run, purgeSent };
}
