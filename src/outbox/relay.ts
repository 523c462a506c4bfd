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

/** A claimed row and where it goes, as stored with it (migration 009; see {@linkcode MAIL_DESTINATION}). */
export interface ClaimedRow extends OutboxRow {
  /** The host (and port) of the payload's `webhook` URL, lower-cased; for every other row, the mail provider. */
  destination: string;
  /**
   * The tenant that chose the destination: a webhook row's tenant; '' for the mail provider, which no tenant
   * chooses. A tenant's webhooks share one cap of the slots, however many host names they use.
   */
  owner: string;
}

/**
 * The destination of every row that is not a webhook: the one mail provider (no host name has a space).
 * Migration 009 spells it in the stored `destination` column; the two must stay the same.
 */
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
   * (at least 1). A destination that has not failed since its last success may borrow more, up to `batch` minus
   * one share (a share of the slots always stays for the others), while its recent sends were fast, or while
   * no other destination has due rows.
   */
  destinationShare?: number;
  /**
   * The sends in flight that one tenant's webhooks may hold together in {@linkcode Relay.run}, whatever hosts
   * they go to; unset, the destination share. It borrows as a destination does, by its webhooks' recent sends,
   * or while no other tenant has due rows. Emails are not counted: the mail provider is nobody's.
   */
  tenantShare?: number;
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
   * It does not apply the destinations' and tenants' shares: those are {@linkcode Relay.run}'s, which keeps
   * sending while a slow send is in flight. @returns how many rows were claimed.
   */
  runOnce(): Promise<number>;
  /** Claims up to `batch` due rows under a lease (exposed for crash tests). */
  claim(): Promise<ClaimedRow[]>;
  /** Sends claimed rows and records each outcome (exposed for crash tests). */
  deliver(rows: ClaimedRow[]): Promise<void>;
  /**
   * Loops until `signal` aborts: keeps up to `batch` sends in flight, each destination and each tenant's webhooks
   * within their shares (see `destinationShare`, `tenantShare`), and claims more as slots free up; wakes on NOTIFY, falls back to a slow poll; on stop,
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
/** A destination or tenant whose sends take less than this on average (and none failed since) may borrow slots. */
const FAST_SEND_MS = 1_000;
/** Weight of the newest send in a destination's (or a tenant's) average send time. */
const SEND_TIME_WEIGHT = 0.2;
/** Destinations (and tenants) whose statistics are remembered; past it, those not backed off are forgotten. */
const MAX_TRACKED = 1_000;
/**
 * A job's outcome row is kept at least as long as anything may still ask about the job, plus a day: its
 * Redis status record and its dead letters (both 7 days). A dead letter's replay reads it to refuse a job
 * that already had its effects, and a job is decided (failed) before it is dead-lettered, so its outcome
 * always outlives its dead letters.
 */
const OUTCOME_MIN_AGE_MS = (Math.max(JOB_RECORD_TTL_S, DEAD_LETTER_BOUNDS.maxAgeS) + 24 * 3600) * 1000;

/**
 * How many rows one claim may take from a destination or a tenant's webhooks: `budget` while another one
 * (destination, or tenant) has due rows in the claim, `alone` while none has. 0 and 0 excludes it.
 */
interface Budget {
  budget: number;
  alone: number;
}

/** Budgets of the listed destinations (or tenants), and what every other one may take (either way). */
interface Budgets {
  listed: Map<string, Budget>;
  others: number;
}

/** How many rows one claim may take: in all, per destination, and per tenant's webhooks. */
interface ClaimLimits {
  limit: number;
  destinations: Budgets;
  owners: Budgets;
}

/** What the relay remembers about the recent sends to one destination, or of one tenant's webhooks. */
interface SendStats {
  /** Moving average of its sends' durations in ms, timeouts included; unset until one ended. */
  sendMs?: number;
  /** Timeouts and connection errors since its last success. */
  failures: number;
}

/** What the relay remembers about one destination. */
interface DestinationStats extends SendStats {
  /** Backoffs since its last success: the next one waits base × 2^backoffs. */
  backoffs: number;
  /** Until when (on the relay's clock) its rows are not sent. */
  until: number;
}

const NO_BUDGET: Budget = { budget: 0, alone: 0 };

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
  const ownerShare = Math.max(1, Math.floor(options.tenantShare ?? share));
  const events = options.events ?? {};
  const stopping = new AbortController();
  const stats = new Map<string, DestinationStats>();
  /** Send statistics of each tenant's webhooks (rows whose `owner` is the tenant). */
  const ownerStats = new Map<string, SendStats>();
  const recordingFailures = new Set<Promise<void>>();

  /** How long `destination` is still backed off, in ms (0: not). */
  function backedOffFor(destination: string): number {
    const d = stats.get(destination);
    return d ? Math.max(0, Math.ceil(d.until - now())) : 0;
  }

  function statsOf(destination: string): DestinationStats {
    let d = stats.get(destination);
    if (!d) {
      if (stats.size >= MAX_TRACKED) {
        for (const [key, old] of stats) if (old.until <= now()) stats.delete(key);
      }
      stats.set(destination, d = { failures: 0, backoffs: 0, until: 0 });
    }
    return d;
  }

  function ownerStatsOf(owner: string): SendStats {
    let o = ownerStats.get(owner);
    if (!o) {
      // Forgetting a tenant only takes its borrowing away until its next sends end.
      if (ownerStats.size >= MAX_TRACKED) ownerStats.clear();
      ownerStats.set(owner, o = { failures: 0 });
    }
    return o;
  }

  /**
   * How many more sends a destination (or a tenant's webhooks) with `s` and `held` sends in flight may start
   * in {@linkcode Relay.run}. Its cap is its share; it may borrow up to all slots but one share (which stays
   * for the others) if none of its sends failed since its last success and either its recent sends were fast
   * or no other one has due rows (`alone`). One never seen and a failing one keep to their share, so however
   * it hangs, the others keep their slots. A slow one keeps to its share only while others wait.
   */
  function budgetOf(s: SendStats | undefined, held: number, share: number): Budget {
    const borrowCap = Math.max(share, options.batch - share);
    const healthy = s?.sendMs !== undefined && s.failures === 0;
    const fast = healthy && s.sendMs! < FAST_SEND_MS;
    return {
      budget: Math.max(0, (fast ? borrowCap : share) - held),
      alone: Math.max(0, (healthy ? borrowCap : share) - held),
    };
  }

  /** The budgets of every destination (or tenant) this relay knows of or has sends in flight to. */
  function budgetsOf(known: Map<string, SendStats>, inFlight: Map<string, number>, share: number): Budgets {
    const listed = new Map<string, Budget>();
    for (const key of new Set([...known.keys(), ...inFlight.keys()])) {
      const b = budgetOf(known.get(key), inFlight.get(key) ?? 0, share);
      if (b.budget !== share || b.alone !== share) listed.set(key, b);
    }
    return { listed, others: share };
  }

  /**
   * Claims due rows within `limits`, in one statement. A row's lane is its (owner, destination). The claim
   * walks the lanes that have unsent rows (one probe of outbox_lanes each; a tenant whose webhooks are at
   * their cap is passed over in one probe), reads each lane's first due rows up to what its destination and
   * owner could take (so no backlog, however deep, hides another lane's rows), keeps each destination's and
   * each tenant's budget of them in (next_attempt_at, id) order, and leases those it can lock (SKIP LOCKED:
   * another relay's claim in the same instant keeps what it locked).
   * @returns the rows, and whether more may be due that these limits allow (the claim was full, another relay
   * took rows it picked, or a tenant's budget cut rows that had taken a destination's budget).
   */
  async function claimRows(
    { limit, destinations, owners }: ClaimLimits,
  ): Promise<{ rows: ClaimedRow[]; more: boolean }> {
    const token = crypto.randomUUID();
    const dNames = [...destinations.listed.keys()];
    const dBudgets = [...destinations.listed.values()];
    const oNames = [...owners.listed.keys()];
    const oBudgets = [...owners.listed.values()];
    const ownerFull = sql`(n.owner <> '' AND coalesce(
      (SELECT alone FROM owner_budget b WHERE b.owner = n.owner), ${owners.others}::int) = 0)`;
    const result = await sql<(ClaimedRow & { picked: number; cut: number })[]>`
      WITH RECURSIVE destination_budget AS (
        SELECT * FROM unnest(${dNames}::text[], ${dBudgets.map((b) => b.budget)}::int[],
          ${dBudgets.map((b) => b.alone)}::int[]) AS b(destination, budget, alone)
      ), owner_budget AS (
        SELECT * FROM unnest(${oNames}::text[], ${oBudgets.map((b) => b.budget)}::int[],
          ${oBudgets.map((b) => b.alone)}::int[]) AS b(owner, budget, alone)
      ), lanes AS (
        -- A loose index scan: the next lane after l, or, when l's owner is at its cap, the next owner's first.
        -- Exactly one branch of the inner UNION ALL runs (the other's condition on l is false).
        SELECT n.owner, n.destination, ${ownerFull} AS owner_full FROM (
          SELECT destination_owner AS owner, destination FROM outbox WHERE sent_at IS NULL AND failed_at IS NULL
          ORDER BY destination_owner, destination LIMIT 1
        ) n
        UNION ALL
        SELECT n.owner, n.destination, ${ownerFull} FROM lanes l CROSS JOIN LATERAL (
          (SELECT destination_owner AS owner, destination FROM outbox
            WHERE sent_at IS NULL AND failed_at IS NULL AND NOT l.owner_full
              AND (destination_owner, destination) > (l.owner, l.destination)
            ORDER BY destination_owner, destination LIMIT 1)
          UNION ALL
          (SELECT destination_owner, destination FROM outbox
            WHERE sent_at IS NULL AND failed_at IS NULL AND l.owner_full AND destination_owner > l.owner
            ORDER BY destination_owner, destination LIMIT 1)
        ) n
      ), due AS (
        -- Each lane's first due rows, at most what its destination and its owner could take in this claim.
        SELECT r.id, r.next_attempt_at, r.tenant, l.owner, l.destination
        FROM lanes l
        LEFT JOIN destination_budget db ON db.destination = l.destination
        LEFT JOIN owner_budget ob ON ob.owner = l.owner
        CROSS JOIN LATERAL (
          SELECT o.id, o.next_attempt_at, o.payload->>'tenant' AS tenant FROM outbox o
          WHERE o.destination_owner = l.owner AND o.destination = l.destination
            AND o.sent_at IS NULL AND o.failed_at IS NULL AND o.next_attempt_at <= now()
            AND (o.locked_until IS NULL OR o.locked_until < now())
          ORDER BY o.next_attempt_at, o.id
          LIMIT least(${limit}::int, coalesce(db.alone, ${destinations.others}::int),
            CASE WHEN l.owner = '' THEN ${limit}::int ELSE coalesce(ob.alone, ${owners.others}::int) END)
        ) r
        WHERE NOT l.owner_full
      ), seen AS (
        SELECT count(DISTINCT destination) AS destinations, count(DISTINCT tenant) AS tenants FROM due
      ), ranked AS (
        -- A destination (a tenant) uses its alone budget when the claim saw no other destination's (tenant's)
        -- due rows.
        SELECT due.*,
          row_number() OVER (PARTITION BY due.destination ORDER BY due.next_attempt_at, due.id) AS nth,
          CASE WHEN s.destinations = 1 THEN coalesce(db.alone, ${destinations.others}::int)
            ELSE coalesce(db.budget, ${destinations.others}::int) END AS room,
          CASE WHEN s.tenants = 1 THEN coalesce(ob.alone, ${owners.others}::int)
            ELSE coalesce(ob.budget, ${owners.others}::int) END AS owner_room
        FROM due CROSS JOIN seen s
        LEFT JOIN destination_budget db ON db.destination = due.destination
        LEFT JOIN owner_budget ob ON ob.owner = due.owner
      ), within_destination AS (
        SELECT *, row_number() OVER (PARTITION BY owner ORDER BY next_attempt_at, id) AS nth_of_owner
        FROM ranked WHERE nth <= room
      ), picked AS (
        SELECT id, destination, owner FROM within_destination WHERE owner = '' OR nth_of_owner <= owner_room
        ORDER BY next_attempt_at, id
        LIMIT ${limit}
      ), locked AS (
        -- The guard is checked again under the lock, on the row's newest version: a row another relay claimed,
        -- or made wait (a backoff, a deferral), since this statement read it is not ours. (coalesce(...) IS
        -- NULL is sent_at IS NULL AND failed_at IS NULL spelled so that the planner looks the picked ids up by
        -- primary key, not through a due index.)
        SELECT id FROM outbox
        WHERE id = ANY(ARRAY(SELECT id FROM picked)) AND coalesce(sent_at, failed_at) IS NULL
          AND next_attempt_at <= now() AND (locked_until IS NULL OR locked_until < now())
        FOR UPDATE SKIP LOCKED
      ), claimed AS (
        UPDATE outbox SET locked_until = now() + ${options.leaseMs} * interval '1 millisecond',
          claim_token = ${token}
        FROM picked WHERE outbox.id = ANY(ARRAY(SELECT id FROM locked)) AND picked.id = outbox.id
        RETURNING outbox.id::text, topic, dedupe_key, payload, attempts, claim_token::text, picked.destination,
          picked.owner
      )
      SELECT c.*, (SELECT count(*) FROM picked)::int AS picked,
        (SELECT count(*) FROM within_destination WHERE owner <> '' AND nth_of_owner > owner_room)::int AS cut
      FROM (VALUES (1)) AS one LEFT JOIN claimed c ON true`;
    const picked = result[0]?.picked ?? 0;
    const cut = result[0]?.cut ?? 0;
    const rows: ClaimedRow[] = [];
    for (const { picked: _, cut: __, ...row } of result) if (row.id !== null) rows.push(row);
    // Rows a tenant's budget cut may have kept others of their destination out: claim again (it progressed).
    return { rows, more: rows.length >= limit || rows.length < picked || (rows.length > 0 && cut > 0) };
  }

  async function claim(): Promise<ClaimedRow[]> {
    const { rows } = await claimRows({
      limit: options.batch,
      destinations: {
        listed: new Map(backedOff().map((destination) => [destination, NO_BUDGET])),
        others: options.batch,
      },
      owners: { listed: new Map(), others: options.batch },
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
   * Counts a failed send against its destination (and its owner, for a webhook). After `destinationFailures`
   * timeouts or connection errors in a row, the destination is backed off: this relay claims none of its rows
   * until the backoff ends, and its due rows wait (next_attempt_at, no attempt spent; see
   * {@linkcode backOff}). Only sends that failed spend attempts.
   * @returns the backoff this failure starts, in ms, if it starts one.
   */
  function countFailure({ destination, owner }: ClaimedRow, error: unknown): number | undefined {
    const reason = reasonOf(error);
    if (reason !== "timeout" && reason !== "connection") return undefined;
    if (owner !== "") ownerStatsOf(owner).failures++;
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
            AND (locked_until IS NULL OR locked_until < now()) AND destination = ${destination}
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

  /** Adds a send that ended to its destination's (and owner's) average send time. */
  function timeSend({ destination, owner }: ClaimedRow, started: number): void {
    const ms = performance.now() - started;
    for (const s of owner === "" ? [statsOf(destination)] : [statsOf(destination), ownerStatsOf(owner)]) {
      s.sendMs = s.sendMs === undefined ? ms : s.sendMs + SEND_TIME_WEIGHT * (ms - s.sendMs);
    }
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
      timeSend(row, started);
      const backoff = countFailure(row, error);
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
    timeSend(row, started);
    const d = statsOf(row.destination);
    d.failures = 0;
    d.backoffs = 0;
    d.until = 0;
    if (row.owner !== "") ownerStatsOf(row.owner).failures = 0;
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
    /** Sends in flight of each tenant's webhooks. */
    const perOwner = new Map<string, number>();
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

    /** Counts a send in (+1) or out (-1) of `inFlight`; @returns how many it held before. */
    const count = (inFlight: Map<string, number>, key: string, by: 1 | -1): number => {
      const held = inFlight.get(key) ?? 0;
      if (held + by > 0) inFlight.set(key, held + by);
      else inFlight.delete(key);
      return held;
    };

    const start = (row: ClaimedRow) => {
      const { destination, owner } = row;
      count(perDestination, destination, 1);
      if (owner !== "") count(perOwner, owner, 1);
      const done: Promise<void> = send(row).finally(() => {
        const wasFull = sending.size >= options.batch;
        sending.delete(done);
        const held = count(perDestination, destination, -1);
        const ownerHeld = owner === "" ? 0 : count(perOwner, owner, -1);
        // Rows may have waited for this slot: all slots were taken, or this destination, or this tenant's
        // webhooks, were at their share (or past it, borrowed).
        if (wasFull || held >= share || ownerHeld >= ownerShare) scan = true;
        nudge();
      });
      sending.add(done);
    };

    /** Claims what the free slots and each destination's and tenant's share allow, and starts those sends. */
    const fill = async (): Promise<boolean> => {
      const limit = options.batch - sending.size;
      const destinations = budgetsOf(stats, perDestination, share);
      for (const destination of backedOff()) destinations.listed.set(destination, NO_BUDGET);
      const owners = budgetsOf(ownerStats, perOwner, ownerShare);
      // Claimed just before their sends start: each row's lease runs from its send's start.
      const { rows, more } = await claimRows({ limit, destinations, owners });
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
