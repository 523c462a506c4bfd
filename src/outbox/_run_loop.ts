/**
 * A relay's run loop: keeps up to `batch` sends in flight, each destination
 * and each tenant's webhooks within their shares, and claims more as slots
 * free up; wakes on NOTIFY and falls back to a slow poll. Private to the
 * relay.
 */
import type { Sql } from "postgres";
import { sleep } from "../async/timeout.ts";
import type { Logger } from "../log/logger.ts";
import type { ClaimLimits } from "./outbox_store.ts";
import type { Delivery } from "./_delivery.ts";
import type { LeasedRow } from "./_relay_types.ts";
import type { SendStats } from "./_send_stats.ts";

/** What the loop needs from its relay. */
export interface RunLoopDeps {
  sql: Sql;
  log: Logger;
  delivery: Delivery;
  stats: SendStats;
  /** Claims due rows within the limits under the relay's lease. */
  claimRows(limits: ClaimLimits): Promise<{ rows: LeasedRow[]; more: boolean }>;
  /** The relay's shutdown: aborted when the grace after a stop runs out, which cuts off sends in flight. */
  stopping: AbortController;
}

/** The numbers the loop works with, resolved from the relay's options and tuning. */
export interface RunLoopSettings {
  batch: number;
  share: number;
  ownerShare: number;
  pollMs: number;
  /** The NOTIFY channel that outbox inserts signal. */
  channel: string;
  /** How long sends in flight may run after a stop before they are cut off. */
  shutdownGraceMs: number;
  /** How long the loop waits after a claim failed before it claims again. */
  failedPassPauseMs: number;
}

/** Counts a send in (+1) or out (-1) of `inFlight`; @returns how many it held before. */
function count(inFlight: Map<string, number>, key: string, by: 1 | -1): number {
  const held = inFlight.get(key) ?? 0;
  if (held + by > 0) inFlight.set(key, held + by);
  else inFlight.delete(key);
  return held;
}

/**
 * Loops until `signal` aborts; on stop, lets the sends in flight finish within the shutdown grace, then
 * aborts them (their rows keep the lease and go again when it runs out).
 */
export async function runRelayLoop(deps: RunLoopDeps, settings: RunLoopSettings, signal: AbortSignal): Promise<void> {
  const { sql, log, delivery, stats, stopping } = deps;
  const { batch, share, ownerShare, pollMs } = settings;
  // Every send until its outcome is recorded; and of those, the ones holding a slot: a send holds its slot until
  // the provider answered, and a success then gives it up while its mark is written, unless `batch` marks are
  // being written already (so at most `batch` sends are in flight, and at most `batch` more await their marks).
  const sending = new Set<Promise<void>>();
  let slotted = 0;
  let marking = 0;
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
  const listener = await sql.listen(settings.channel, () => {
    scan = true;
    nudge();
  });
  // The grace timer starts at the stop, not when the loop notices it.
  let grace: ReturnType<typeof setTimeout> | undefined;
  const onAbort = () => {
    nudge();
    grace = setTimeout(() => stopping.abort(new Error("relay stopping")), settings.shutdownGraceMs);
  };
  signal.addEventListener("abort", onAbort);

  const start = (row: LeasedRow) => {
    const { destination, owner } = row;
    count(perDestination, destination, 1);
    if (owner !== "") count(perOwner, owner, 1);
    slotted++;
    let holding = true;
    const freeSlot = () => {
      if (!holding) return;
      holding = false;
      const wasFull = slotted >= batch;
      slotted--;
      const held = count(perDestination, destination, -1);
      const ownerHeld = owner === "" ? 0 : count(perOwner, owner, -1);
      // Rows may have waited for this slot: all slots were taken, or this destination, or this tenant's
      // webhooks, were at their share (or past it, borrowed).
      if (wasFull || held >= share || ownerHeld >= ownerShare) scan = true;
      nudge();
    };
    let marked = false;
    const done: Promise<void> = delivery.send(row, () => {
      if (marked || !holding || marking >= batch) return;
      marking++;
      marked = true;
      freeSlot();
    }).finally(() => {
      if (marked) marking--;
      freeSlot();
      sending.delete(done);
    });
    sending.add(done);
  };

  /** Claims what the free slots and each destination's and tenant's share allow, and starts those sends. */
  const fill = async (): Promise<boolean> => {
    const limit = batch - slotted;
    const { destinations, owners } = stats.budgets(perDestination, perOwner);
    // Claimed just before their sends start: each row's lease runs from its send's start.
    const { rows, more } = await deps.claimRows({ limit, destinations, owners });
    for (const row of await delivery.admit(rows)) start(row);
    return more;
  };

  let nextPoll = performance.now();
  try {
    while (!signal.aborted) {
      if (performance.now() >= nextPoll) {
        scan = true;
        nextPoll = performance.now() + pollMs;
      }
      if (scan && slotted < batch) {
        scan = false;
        try {
          if (await fill()) scan = true;
        } catch (error) {
          if (signal.aborted) break;
          log.warn("relay_pass_failed", { error });
          await sleep(settings.failedPassPauseMs, signal).catch(() => {});
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
