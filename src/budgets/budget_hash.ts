/**
 * A tenant's budget hash: its spend and in-flight reservations, per UTC day
 * and per UTC month, in one Redis hash under the tenant's own hash tag (the
 * slot of its lane, so it works on a Redis Cluster; its name comes from
 * `BudgetKeys`, in `budgets.ts`). Every decision is one Lua script on that one key
 * (`reserve_script.ts`, `settle_script.ts`, `reinstate_script.ts`,
 * `seed_script.ts`; `read_script.ts` only reads): reservations by any number
 * of workers can never together pass a limit. Which day it is comes from
 * Redis's own clock (`TIME`), so workers on hosts with different clocks agree
 * on when a day ends; the calendar around it (the month a day is in) comes
 * from the caller, and a script asked about another day than Redis's writes
 * nothing and is asked again about Redis's ({@linkcode runOnHash}). The
 * scripts name the months of days from the previous month's first to the
 * next month's last; a reservation older than that (a call in flight for
 * over a month: calls last minutes) would be charged to its day alone.
 *
 * Four budgets, in this order everywhere: tokens per day, USD per day,
 * tokens per month, USD per month. USD are whole nano-dollars (see
 * `prices.ts`). A limit of -1 is no limit.
 *
 * Fields: `d<day>:tok|usd` (spent; day = days since the epoch),
 * `m<month>:tok|usd` (month = year * 12 + month - 1), `d<day>:flags` /
 * `m<month>:flags` (thresholds already announced), `day` / `month` (the
 * newest periods seen, for clean-up), `seeded` (the spend was seeded from
 * Postgres's record), `inc` (the hash's incarnation), `waiting_until` (while
 * a worker holds the tenant's runs back), and the reservations: per lease
 * epoch of 15 minutes (`r<epoch>:tok|usd`, the epochs listed in `open`; a day
 * and a month are whole epochs, so an epoch's day and month are its own). A
 * reservation settles in its own epoch. One still open an epoch later
 * belongs to a call whose settlement never came (its worker was killed, or
 * Redis refused the settle): it may have been billed, so it is charged as
 * spent to its day and month, and a late settlement corrects it by the
 * difference. A reservation therefore counts as in flight for at most 30
 * minutes.
 *
 * A batch line's hold (issue 43) is not a call's reservation: `B:<run id>` (`ms,tokens,nano-USD`, `ms` when it
 * was held) with the sums `bh:tok` / `bh:usd`. It lasts until its line settles (`hold_script.ts`,
 * `settle_hold_script.ts`), up to a day or more, and counts meanwhile against the current day and month,
 * whichever they are, since its charge will be spent in the period its line settles in.
 *
 * Every reservation has an id (a UUID the worker draws), and only its own
 * settlement removes it, once: `R:<id>` holds a live reservation (`epoch,tokens,nano-USD`), `X:<id>` one that
 * outlived its epoch and was charged whole (a late settlement charges the difference and removes it), `D:<id>` a
 * settlement done in a hash that never held the reservation (it was lost and rebuilt). ioredis resends, after a
 * reconnect, every command whose reply it did not get, and Redis may already have run it: a reserve run twice
 * finds its `R:<id>` and answers as the first did; a settle run twice finds nothing of its id left and does
 * nothing. A reservation reinstated after a loss (see the reinstate script) is `R:<id>` again.
 */
import type { RedisClient } from "../clients.ts";
import type { Script } from "../redis/script.ts";
import { NotReplicated, type ReplicaAck } from "../redis/replica_ack.ts";

/** The four budgets' limits: tokens/day, nano-USD/day, tokens/month, nano-USD/month; -1 = none. */
export type Limits = [number, number, number, number];

/** How long a tenant's budget hash outlives its last use: past the previous month. */
export const BUDGET_STATE_TTL_MS = 70 * 24 * 3600 * 1000;

/** A reservation's lease epoch: 15 minutes (a day is 96 of them, so no epoch spans two days or two months). */
export const RESERVATION_EPOCH_MS = 15 * 60_000;

const DAY_MS = 86_400_000;

/** The month of a day number as the hash names it: year * 12 + month - 1, in UTC. */
export function monthOfDay(day: number): number {
  const date = new Date(day * DAY_MS);
  return date.getUTCFullYear() * 12 + date.getUTCMonth();
}

/**
 * The calendar a script is given about the day at `ms`: the day, its month, and the first days of the previous,
 * this and the next month (so a script names the month of any day from the previous month's first to the next
 * month's last without calendar arithmetic of its own).
 */
export interface Periods {
  day: number;
  month: number;
  prev_month_first: number;
  month_first: number;
  next_month_first: number;
}

/** The {@linkcode Periods} of the day at epoch ms `ms`. */
export function periodsAt(ms: number): Periods {
  const date = new Date(ms);
  const [year, month] = [date.getUTCFullYear(), date.getUTCMonth()];
  const first = (months: number) => Date.UTC(year, month + months, 1) / DAY_MS;
  return {
    day: Math.floor(ms / DAY_MS),
    month: year * 12 + month,
    prev_month_first: first(-1),
    month_first: first(0),
    next_month_first: first(1),
  };
}

/** The current periods' spend and reservations, at Redis's clock. */
export interface BudgetState {
  now: number;
  day: number;
  month: number;
  spent: Limits;
  reserved: Limits;
  /** The hash was seeded from Postgres's record (see the seed script); false when it was lost, or never made. */
  seeded: boolean;
}

/** A field's number as Lua's `tonumber(v) or 0` reads it. */
function count(value: unknown): number {
  const n = value === null || value === undefined || value === false ? 0 : Number(value);
  return Number.isFinite(n) ? n : 0;
}

/**
 * Counts the state a script read at Redis's `now` (the read and settle scripts' snapshot: the current day's and
 * month's spend fields in the budgets' order, then one `epoch,tokens,nano-USD` per open epoch). Reservations of
 * epochs before the previous one never settled: they count as spent (the next reservation charges them for good);
 * the others are in flight. Each counts in the budgets whose period is its epoch's.
 */
export function stateOf(now: number, seeded: boolean, snapshot: readonly unknown[]): BudgetState {
  const day = Math.floor(now / DAY_MS);
  const month = monthOfDay(day);
  const epoch = Math.floor(now / RESERVATION_EPOCH_MS);
  const spent: Limits = [count(snapshot[0]), count(snapshot[1]), count(snapshot[2]), count(snapshot[3])];
  const reserved: Limits = [0, 0, 0, 0];
  for (const entry of snapshot.slice(4)) {
    // 'h,tokens,nano-USD': the batch lines' holds, which count against whichever day and month are current.
    if (String(entry).startsWith("h,")) {
      const [, tokens = 0, nanos = 0] = String(entry).split(",").map(count);
      for (let i = 0; i < 4; i++) reserved[i]! += Math.max(0, i % 2 === 0 ? tokens : nanos);
      continue;
    }
    const [n = 0, tokens = 0, nanos = 0] = String(entry).split(",").map(count);
    const ownDay = Math.floor(n * RESERVATION_EPOCH_MS / DAY_MS);
    const ownMonth = monthOfDay(ownDay);
    for (let i = 0; i < 4; i++) {
      if (i < 2 ? ownDay !== day : ownMonth !== month) continue;
      const amount = Math.max(0, i % 2 === 0 ? tokens : nanos);
      if (n < epoch - 1) spent[i]! += amount;
      else reserved[i]! += amount;
    }
  }
  return { now, day, month, spent, reserved, seeded };
}

/**
 * A whole, non-negative number for a script: HINCRBY refuses anything else, and Redis does not undo a script's
 * earlier writes when a later command fails.
 */
export function whole(n: number): number {
  return Number.isFinite(n) ? Math.max(0, Math.ceil(n)) : 0;
}

/** A script's answer when Redis's day is not the one it was asked about: `[-3, Redis's now]`; it wrote nothing. */
const OTHER_DAY = -3;

/**
 * Runs a budget script on the tenant's hash `key` with one JSON argument: `args`, with the lease epoch, the hash's
 * TTL and the periods of this host's clock. A script that finds Redis on another day (this host's clock is off, or
 * midnight passed) wrote nothing: it is asked again with the periods of Redis's own time. With `ack`
 * (REDIS_MIN_REPLICAS_ACK) each run is followed by a WAIT in the same round trip: then `replicated` says whether
 * enough replicas have its writes; with `orAlone`, a run that found no connection free to wait on goes without one.
 */
export async function runOnHash(
  redis: RedisClient,
  ack: ReplicaAck | undefined,
  script: Script,
  key: string,
  args: Record<string, unknown>,
  { orAlone = false }: { orAlone?: boolean } = {},
): Promise<{ reply: unknown[]; replicated: boolean }> {
  let at = Date.now();
  for (let tries = 1;; tries++) {
    const argv = [
      JSON.stringify({ ...args, ...periodsAt(at), lease_ms: RESERVATION_EPOCH_MS, ttl_ms: BUDGET_STATE_TTL_MS }),
    ];
    const { result, replicated } = await runWithAck(redis, ack, script, [key], argv, orAlone);
    const reply = result as unknown[];
    if (Number(reply[0]) !== OTHER_DAY) return { reply, replicated };
    if (tries >= 3) {
      throw new Error(`Redis's clock (${reply[1]} ms) kept leaving the day a budget script was asked about`);
    }
    at = Number(reply[1]);
  }
}

async function runWithAck(
  redis: RedisClient,
  ack: ReplicaAck | undefined,
  script: Script,
  keys: string[],
  args: string[],
  orAlone: boolean,
): Promise<{ result: unknown; replicated: boolean }> {
  if (!ack) return { result: await script.run(redis, keys, args), replicated: true };
  try {
    const { result, replicated } = await ack.run(script, keys, args);
    return { result, replicated };
  } catch (error) {
    // No connection came free to wait on (nothing ran): with `orAlone`, run without the WAIT rather than not at all.
    if (!orAlone || !(error instanceof NotReplicated) || error.details.ran) throw error;
    return { result: await script.run(redis, keys, args), replicated: false };
  }
}
