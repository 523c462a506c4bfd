/**
 * What a relay remembers about its recent sends, per destination and per
 * tenant's webhooks: average send time, failures since the last success,
 * and each destination's backoff. From these come the budgets a claim may
 * take from each (the shares and their borrowing) and whether a destination
 * is backed off. Private to the relay; its numbers come from `RELAY_DEFAULTS`
 * and `RELAY_TUNING`.
 */
import { reasonOf } from "../retry/classify.ts";
import type { Budget, Budgets, ClaimedRow } from "./outbox_store.ts";

/** What the relay remembers about the recent sends to one destination, or of one tenant's webhooks. */
interface SendStatsOf {
  /** Moving average of its sends' durations in ms, timeouts included; unset until one ended. */
  sendMs?: number;
  /** Timeouts and connection errors since its last success. */
  failures: number;
}

/** What the relay remembers about one destination. */
interface DestinationStats extends SendStatsOf {
  /** Backoffs since its last success: the next one waits base × 2^backoffs. */
  backoffs: number;
  /** Until when (on the relay's clock) its rows are not sent. */
  until: number;
}

/** A budget that excludes its destination (or tenant) from a claim. */
export const NO_BUDGET: Budget = { budget: 0, alone: 0 };

/** The numbers {@linkcode createSendStats} works with, resolved from the relay's options and tuning. */
export interface SendStatsSettings {
  /** The relay's batch: all its slots. */
  batch: number;
  /** A destination's share of the slots. */
  share: number;
  /** A tenant's webhooks' share of the slots. */
  ownerShare: number;
  /** Timeouts or connection errors in a row before a destination is backed off. */
  failuresBeforeBackoff: number;
  destinationBaseMs: number;
  destinationCapMs: number;
  /** Sends faster than this on average (and none failed since) may borrow slots. */
  fastSendMs: number;
  /** Weight of the newest send in an average send time. */
  sendTimeWeight: number;
  /** Destinations (and tenants) remembered; past it, those not backed off are forgotten. */
  maxTracked: number;
  /** A monotonic clock in ms. */
  now: () => number;
}

/** A relay's memory of its sends. */
export interface SendStats {
  /** How long `destination` is still backed off, in ms (0: not). */
  backedOffFor(destination: string): number;
  /** The destinations backed off now. */
  backedOff(): string[];
  /**
   * The budgets of every destination and every tenant's webhooks this relay knows of or has sends in flight to
   * (`perDestination`, `perOwner`: sends in flight of each); a backed-off destination gets none.
   */
  budgets(
    perDestination: Map<string, number>,
    perOwner: Map<string, number>,
  ): { destinations: Budgets; owners: Budgets };
  /** Adds a send that ended (at `started`, on `performance.now()`) to its destination's (and owner's) average. */
  timeSend(row: ClaimedRow, started: number): void;
  /**
   * Counts a failed send against its destination (and its owner, for a webhook). After `failuresBeforeBackoff`
   * timeouts or connection errors in a row, the destination is backed off: the relay claims none of its rows
   * until the backoff ends, and its due rows wait. @returns the backoff this failure starts, in ms, if it starts one.
   */
  countFailure(row: ClaimedRow, error: unknown): number | undefined;
  /** A success ends its destination's backoff and clears its (and its owner's) failures. */
  succeeded(row: ClaimedRow): void;
  /** Failures of `destination` since its last success, if it is remembered. */
  failuresOf(destination: string): number | undefined;
}

/** Creates a relay's memory of its sends. */
export function createSendStats(settings: SendStatsSettings): SendStats {
  const { batch, now } = settings;
  const stats = new Map<string, DestinationStats>();
  /** Send statistics of each tenant's webhooks (rows whose `owner` is the tenant). */
  const ownerStats = new Map<string, SendStatsOf>();

  function statsOf(destination: string): DestinationStats {
    let d = stats.get(destination);
    if (!d) {
      if (stats.size >= settings.maxTracked) {
        for (const [key, old] of stats) if (old.until <= now()) stats.delete(key);
      }
      stats.set(destination, d = { failures: 0, backoffs: 0, until: 0 });
    }
    return d;
  }

  function ownerStatsOf(owner: string): SendStatsOf {
    let o = ownerStats.get(owner);
    if (!o) {
      // Forgetting a tenant only takes its borrowing away until its next sends end.
      if (ownerStats.size >= settings.maxTracked) ownerStats.clear();
      ownerStats.set(owner, o = { failures: 0 });
    }
    return o;
  }

  /**
   * How many more sends a destination (or a tenant's webhooks) with `s` and `held` sends in flight may start
   * in the relay's run loop. Its cap is its share; it may borrow up to all slots but one share (which stays
   * for the others) if none of its sends failed since its last success and either its recent sends were fast
   * or no other one has due rows (`alone`). One never seen and a failing one keep to their share, so however
   * it hangs, the others keep their slots. A slow one keeps to its share only while others wait.
   */
  function budgetOf(s: SendStatsOf | undefined, held: number, share: number): Budget {
    const borrowCap = Math.max(share, batch - share);
    const healthy = s?.sendMs !== undefined && s.failures === 0;
    const fast = healthy && s.sendMs! < settings.fastSendMs;
    return {
      budget: Math.max(0, (fast ? borrowCap : share) - held),
      alone: Math.max(0, (healthy ? borrowCap : share) - held),
    };
  }

  /** The budgets of every destination (or tenant) this relay knows of or has sends in flight to. */
  function budgetsOf(known: Map<string, SendStatsOf>, inFlight: Map<string, number>, share: number): Budgets {
    const listed = new Map<string, Budget>();
    for (const key of new Set([...known.keys(), ...inFlight.keys()])) {
      const b = budgetOf(known.get(key), inFlight.get(key) ?? 0, share);
      if (b.budget !== share || b.alone !== share) listed.set(key, b);
    }
    return { listed, others: share };
  }

  function backedOff(): string[] {
    const t = now();
    return [...stats].filter(([, d]) => d.until > t).map(([destination]) => destination);
  }

  return {
    backedOffFor(destination) {
      const d = stats.get(destination);
      return d ? Math.max(0, Math.ceil(d.until - now())) : 0;
    },
    backedOff,
    budgets(perDestination, perOwner) {
      const destinations = budgetsOf(stats, perDestination, settings.share);
      for (const destination of backedOff()) destinations.listed.set(destination, NO_BUDGET);
      return { destinations, owners: budgetsOf(ownerStats, perOwner, settings.ownerShare) };
    },
    timeSend({ destination, owner }, started) {
      const ms = performance.now() - started;
      for (const s of owner === "" ? [statsOf(destination)] : [statsOf(destination), ownerStatsOf(owner)]) {
        s.sendMs = s.sendMs === undefined ? ms : s.sendMs + settings.sendTimeWeight * (ms - s.sendMs);
      }
    },
    countFailure({ destination, owner }, error) {
      const reason = reasonOf(error);
      if (reason !== "timeout" && reason !== "connection") return undefined;
      if (owner !== "") ownerStatsOf(owner).failures++;
      const d = statsOf(destination);
      d.failures++;
      // Sends already in flight when the backoff began only count; after it, the next failure backs off again.
      if (d.failures < settings.failuresBeforeBackoff || d.until > now()) return undefined;
      const ms = Math.min(settings.destinationCapMs, settings.destinationBaseMs * 2 ** d.backoffs);
      d.backoffs++;
      d.until = now() + ms;
      return ms;
    },
    succeeded({ destination, owner }) {
      // Rows a backoff already moved keep their wait, which is at most this backoff's.
      const d = statsOf(destination);
      d.failures = 0;
      d.backoffs = 0;
      d.until = 0;
      if (owner !== "") ownerStatsOf(owner).failures = 0;
    },
    failuresOf(destination) {
      return stats.get(destination)?.failures;
    },
  };
}
