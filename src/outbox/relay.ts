import type { Sql } from "postgres";
import type { Logger } from "../log/logger.ts";
import type { Mailer } from "../mail/mailer.ts";
import * as outbox from "./outbox_store.ts";
import type { ClaimLimits } from "./outbox_store.ts";
import { createDelivery } from "./_delivery.ts";
import type { Deferral, LeasedRow, OutboxSender, PayloadLoader, RelayEvents, Renderer } from "./_relay_types.ts";
import { runRelayLoop } from "./_run_loop.ts";
import { createSendStats, NO_BUDGET } from "./_send_stats.ts";

export type { ClaimedRow, OutboxRow } from "./outbox_store.ts";
export type { Deferral, LeasedRow, OutboxSender, PayloadLoader, RelayEvents, Renderer } from "./_relay_types.ts";

/**
 * The destination of every row that is not a webhook: the one mail provider (no host name has a space).
 * Migration 009 spells it in the stored `destination` column; the two must stay the same.
 */
export const MAIL_DESTINATION = "mail provider";

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
  /** A monotonic clock in ms, for destination backoff and for how much of a row's lease is left. */
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
  claim(): Promise<LeasedRow[]>;
  /** Sends claimed rows and records each outcome (exposed for crash tests). */
  deliver(rows: LeasedRow[]): Promise<void>;
  /**
   * Loops until `signal` aborts: keeps up to `batch` sends in flight, each destination and each tenant's webhooks
   * within their shares (see `destinationShare`, `tenantShare`), and claims more as slots free up; wakes on NOTIFY, falls back to a slow poll; on stop,
   * lets the sends in flight finish (within the shutdown grace).
   */
  run(signal: AbortSignal): Promise<void>;
}

/** The NOTIFY channel a trigger on outbox inserts signals (see migrations). */
export const OUTBOX_CHANNEL = "oncely_outbox";

/** The relay's fixed numbers: not options, but in one place. */
export const RELAY_TUNING = {
  /** Unset, a destination's share of the slots is the batch over this (at least 1). */
  shareDivisor: 4,
  /** How long a stopping relay lets its sends in flight run before aborting them (the process exits within 10 s). */
  shutdownGraceMs: 5_000,
  /** A destination or tenant whose sends take less than this on average (and none failed since) may borrow slots. */
  fastSendMs: 1_000,
  /** Weight of the newest send in a destination's (or a tenant's) average send time. */
  sendTimeWeight: 0.2,
  /** Destinations (and tenants) whose statistics are remembered; past it, those not backed off are forgotten. */
  maxTracked: 1_000,
  /** How long the run loop waits after a failed claim before it claims again. */
  failedPassPauseMs: 1_000,
  /** The most characters of a send's error kept in the row's `last_error`. */
  lastErrorMaxChars: 1_000,
  /** The most rows one mark-sent statement covers. */
  markSentMaxBatch: 500,
  /** A failed "sent" mark is written again after a random wait of up to this, doubling with each try... */
  markRetryBaseMs: 100,
  /** ...up to this, */
  markRetryCapMs: 2_000,
  /** ...while the row's lease has more than this left after the wait; then it is given up (the lease re-sends it). */
  markLeaseMarginMs: 1_000,
} as const;

/**
 * Creates the outbox relay. No transaction is held across a network call:
 * a claim stamps `locked_until` and a token in one short statement, the send
 * happens outside any transaction, and a second short statement records the
 * outcome. `FOR UPDATE SKIP LOCKED` keeps concurrent relays off each other's
 * rows. A "sent" mark that fails is written again while the row's lease
 * leaves room. A crash after the provider accepted a send but before we
 * recorded it (or a mark that failed until the lease was nearly over) is the
 * one duplicate window; the row's dedupe key, passed to the provider as its
 * Idempotency-Key, closes it.
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
  const now = options.now ?? (() => performance.now());
  const share = Math.max(1, Math.floor(options.destinationShare ?? options.batch / RELAY_TUNING.shareDivisor));
  const ownerShare = Math.max(1, Math.floor(options.tenantShare ?? share));
  const stopping = new AbortController();
  const stats = createSendStats({
    batch: options.batch,
    share,
    ownerShare,
    failuresBeforeBackoff: options.destinationFailures ?? RELAY_DEFAULTS.destinationFailures,
    destinationBaseMs: options.destinationBackoffBaseMs ?? RELAY_DEFAULTS.destinationBackoffBaseMs,
    destinationCapMs: options.destinationBackoffCapMs ?? RELAY_DEFAULTS.destinationBackoffCapMs,
    fastSendMs: RELAY_TUNING.fastSendMs,
    sendTimeWeight: RELAY_TUNING.sendTimeWeight,
    maxTracked: RELAY_TUNING.maxTracked,
    now,
  });
  const delivery = createDelivery({
    sql,
    mailer,
    render,
    senders,
    load,
    defer,
    log,
    events: options.events ?? {},
    stats,
    stopping: stopping.signal,
  }, {
    maxAttempts: options.maxAttempts,
    backoffBaseMs: options.backoffBaseMs ?? RELAY_DEFAULTS.backoffBaseMs,
    backoffCapMs: options.backoffCapMs ?? RELAY_DEFAULTS.backoffCapMs,
    random: options.random ?? Math.random,
    lastErrorMaxChars: RELAY_TUNING.lastErrorMaxChars,
    markSentMaxBatch: RELAY_TUNING.markSentMaxBatch,
    markRetryBaseMs: RELAY_TUNING.markRetryBaseMs,
    markRetryCapMs: RELAY_TUNING.markRetryCapMs,
    markLeaseMarginMs: RELAY_TUNING.markLeaseMarginMs,
    now,
  });
  // The lease is counted from before the claim's statement is sent, so it ends here no later than in Postgres.
  const claimRows = async (limits: ClaimLimits): Promise<{ rows: LeasedRow[]; more: boolean }> => {
    const leaseEndsMs = now() + options.leaseMs;
    const { rows, more } = await outbox.claimRows(sql, limits, options.leaseMs);
    return { rows: rows.map((row) => ({ ...row, leaseEndsMs })), more };
  };

  async function claim(): Promise<LeasedRow[]> {
    const { rows } = await claimRows({
      limit: options.batch,
      destinations: {
        listed: new Map(stats.backedOff().map((destination) => [destination, NO_BUDGET])),
        others: options.batch,
      },
      owners: { listed: new Map(), others: options.batch },
    });
    return rows;
  }

  async function deliver(claimed: LeasedRow[]): Promise<void> {
    const rows = await delivery.admit(claimed);
    await Promise.all(rows.map((row) => delivery.send(row)));
  }

  return {
    claim,
    deliver,
    async runOnce() {
      const rows = await claim();
      if (rows.length > 0) await deliver(rows);
      return rows.length;
    },
    run(signal) {
      return runRelayLoop({ sql, log, delivery, stats, claimRows, stopping }, {
        batch: options.batch,
        share,
        ownerShare,
        pollMs: options.pollMs ?? RELAY_DEFAULTS.pollMs,
        channel: OUTBOX_CHANNEL,
        shutdownGraceMs: RELAY_TUNING.shutdownGraceMs,
        failedPassPauseMs: RELAY_TUNING.failedPassPauseMs,
      }, signal);
    },
  };
}
