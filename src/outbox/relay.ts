import type { Sql } from "postgres";
import { createBatcher } from "../async/batcher.ts";
import { sleep } from "../async/timeout.ts";
import type { Logger } from "../log/logger.ts";
import type { Email, Mailer } from "../mail/mailer.ts";
import { PermanentMailError } from "../mail/mailer.ts";
import { isRetryable, reasonOf } from "../retry/classify.ts";
import { backoffMs } from "../retry/retry_policy.ts";
import { contextFrom, inSpan } from "../tracing.ts";
import * as outbox from "./outbox_store.ts";
import type { Budget, Budgets, ClaimedRow, ClaimLimits, OutboxRow } from "./outbox_store.ts";

export type { ClaimedRow, OutboxRow } from "./outbox_store.ts";

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
}

/** The NOTIFY channel a trigger on outbox inserts signals (see migrations). */
export const OUTBOX_CHANNEL = "oncely_outbox";
/** How long a stopping relay lets its sends in flight run before aborting them (the process exits within 10 s). */
const SHUTDOWN_GRACE_MS = 5_000;
/** A destination or tenant whose sends take less than this on average (and none failed since) may borrow slots. */
const FAST_SEND_MS = 1_000;
/** Weight of the newest send in a destination's (or a tenant's) average send time. */
const SEND_TIME_WEIGHT = 0.2;
/** Destinations (and tenants) whose statistics are remembered; past it, those not backed off are forgotten. */
const MAX_TRACKED = 1_000;
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

  /** Claims due rows within `limits` under this relay's lease (see {@linkcode outbox.claimRows}). */
  function claimRows(limits: ClaimLimits): Promise<{ rows: ClaimedRow[]; more: boolean }> {
    return outbox.claimRows(sql, limits, options.leaseMs);
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
    await outbox.releaseRows(sql, claimed.filter((r) => waits.has(r.id)), waits);
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
      deferred = await outbox.postponeDestination(sql, destination, ms);
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
      await outbox.markFailed(sql, row, { attempts, error: message });
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
    await outbox.scheduleRetry(sql, row, { attempts, error: message, waitMs });
    events.retry?.(row, reason);
    log.info("outbox_send_retry", { ...fields, wait_ms: waitMs });
  }

  // Marking sent needs no token: once the provider accepted it, it is sent, whoever holds the lease.
  // Sends that end while a mark is being written share the next statement; none waits for another send.
  const markSent = createBatcher<{ id: string; providerId: string }>(async (items) => {
    await outbox.markSent(sql, items);
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
    try {
      while (!signal.aborted) {
        if (performance.now() >= nextPoll) {
          scan = true;
          nextPoll = performance.now() + pollMs;
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
      clearTimeout(grace);
      await listener.unlisten();
    }
  }

  return { runOnce, claim, deliver, run };
}
