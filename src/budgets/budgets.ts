/**
 * Tenant budgets: limits in USD and tokens per UTC day and month, kept in
 * Postgres by the tenants store (`tenant budget`), enforced in Redis (one
 * hash per tenant, see `budget_hash.ts`, touched only by this folder).
 *
 * Every process reads the limits of the tenants that have any (one small
 * query, at most every `ttlMs`), so a raised budget takes effect within
 * seconds without a restart; a tenant without a budget costs no Redis round
 * trip at all. Before each model call a worker reserves the call's worst
 * case (see {@linkcode worstCaseTokens}) against every budget and settles it
 * at the charge afterwards (see `charge.ts`); intake refuses a run whose
 * worst case no longer fits what is spent. What the budgets read from
 * Postgres comes through {@linkcode BudgetRecords}, which the stores that own
 * those tables implement; the hash's name through {@linkcode BudgetKeys}.
 */
import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import { GateRefused } from "../retry/errors.ts";
import { type CallEnd, type CallTokens, chargeOf } from "./charge.ts";
import { costNanos, type ModelPrice, nanosToUsd, type Prices, servedModels, usdToNanos } from "../llm/prices.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import type { BudgetView } from "./budget_view.ts";
import { type BudgetState, type Limits, RESERVATION_EPOCH_MS, whole } from "./budget_hash.ts";
import { readBudgetState } from "./read_script.ts";
import { type InFlight, reinstateReservations } from "./reinstate_script.ts";
import { type ReserveReply, runReserve } from "./reserve_script.ts";
import { runSettle } from "./settle_script.ts";
import { type LineHold, seedBudgetState } from "./seed_script.ts";
import { heldIn, runHold } from "./hold_script.ts";
import { runSettleHold } from "./settle_hold_script.ts";

/** A tenant's limits as set (`tenant budget`); absent = none. */
export interface TenantBudget {
  usd_per_day?: number;
  usd_per_month?: number;
  tokens_per_day?: number;
  tokens_per_month?: number;
}

/** The budgets in the scripts' order, as the API names them. */
export const BUDGETS = [
  { period: "day", unit: "tokens" },
  { period: "day", unit: "usd" },
  { period: "month", unit: "tokens" },
  { period: "month", unit: "usd" },
] as const;

/** The name of a tenant's budget hash (under the tenant's lane tag, so in its lane's slot): the key book builds it. */
export interface BudgetKeys {
  budget(tenant: string): string;
}

/** What Postgres's record says a tenant's calls were charged in the current UTC day and month, each at its charge. */
export interface RecordedSpend {
  day: { tokens: number; usd: number };
  month: { tokens: number; usd: number };
  /**
   * The tenant's batch lines in flight that hold their worst case and are not yet charged in the record (no
   * `model_attempts` row): read in the same snapshot as the spend, so each line is in one or the other.
   */
  holds?: LineHold[];
}

/**
 * Whether a batch line a hold was taken for is still in flight (see {@linkcode Budgets.sweepHolds}): recorded in a
 * batch and not settled. A line is settled only once its hold was (the poller settles the hold first, and a
 * failure leaves the line for its next pass), so a hold whose line is settled, or that has no line, is left over.
 */
export type HoldVerdict = { live: boolean };

/**
 * What the budgets read from Postgres, from the stores that own it (wired in `src/processes/`): every tenant's
 * limits (the tenants store) and what a tenant was charged this period (the job store's `model_attempts`).
 */
export interface BudgetRecords {
  limits(): Promise<Map<string, TenantBudget>>;
  spent(tenant: string): Promise<RecordedSpend>;
  /** Which of these run ids' batch lines are still in flight (the holds' sweep); an id not in the map has no line. */
  holdVerdicts?(ids: readonly string[]): Promise<Map<string, HoldVerdict>>;
}

/** Whether any limit is set. */
export function hasBudget(budget: TenantBudget | undefined): budget is TenantBudget {
  return budget !== undefined && Object.values(budget).some((v) => v !== undefined && v !== null);
}

/** The limits in the scripts' units and order; -1 = none. */
export function limitsOf(b: TenantBudget): Limits {
  const n = (v: number | undefined, f: (x: number) => number) => v === undefined || v === null ? -1 : f(v);
  const whole = (x: number) => Math.floor(x);
  return [
    n(b.tokens_per_day, whole),
    n(b.usd_per_day, usdToNanos),
    n(b.tokens_per_month, whole),
    n(b.usd_per_month, usdToNanos),
  ];
}

/**
 * A call's worst case in tokens: the prompt's UTF-8 length in bytes (no byte-level BPE token is shorter than a
 * byte, so this bounds what any such tokenizer counts), a few tokens per message for the chat format, and every
 * output token it may write.
 */
export function worstCaseTokens(messages: readonly string[], maxOutputTokens: number): CallTokens {
  const encoder = new TextEncoder();
  let bytes = 0;
  for (const m of messages) bytes += encoder.encode(m).length;
  return { prompt: bytes + 8 * messages.length + 8, completion: maxOutputTokens };
}

/** When the period that began at Redis time `now` ends: the next UTC midnight, or the first of next month. */
export function periodEnd(period: "day" | "month", now: number): number {
  const d = new Date(now);
  return period === "day"
    ? Date.UTC(d.getUTCFullYear(), d.getUTCMonth(), d.getUTCDate() + 1)
    : Date.UTC(d.getUTCFullYear(), d.getUTCMonth() + 1, 1);
}

/**
 * A budget the call's worst case does not fit: why, and until when (the period's end). A refusal of the gate:
 * the retry policy passes it on unchanged, and the job defers the run (see {@linkcode JobDeferred}).
 */
export class BudgetExhausted extends GateRefused {
  constructor(
    readonly tenant: string,
    readonly budget: { period: "day" | "month"; unit: "usd" | "tokens"; limit: number; spent: number },
    readonly untilMs: number,
    readonly now: number,
    /** The refused worst case, in tokens: what must fit again before the tenant's runs go on. */
    readonly worst: { tokens: number; nanos: number },
  ) {
    // What did not fit is the call's worst case in what is left, which may be far from the whole limit: saying only
    // "spent (244 of 1,300 tokens)" read as a wrong count.
    const unitName = budget.unit === "usd" ? " USD" : " tokens";
    const worstShown = budget.unit === "usd" ? Math.round(nanosToUsd(worst.nanos) * 1e6) / 1e6 : worst.tokens;
    const left = Math.max(0, Math.round((budget.limit - budget.spent) * 1e9) / 1e9);
    super(
      `tenant ${tenant}'s ${budget.unit === "usd" ? "USD" : "token"} budget per ${budget.period} has ` +
        `${left}${unitName} left of ${budget.limit}${unitName} (${budget.spent} spent or held by calls under way), ` +
        `less than the call's worst case of ${worstShown}${unitName} (its prompt and every output token it may write)`,
    );
    this.name = "BudgetExhausted";
  }

  /** Seconds until the period ends (Retry-After). */
  get retryAfterS(): number {
    return Math.max(1, Math.ceil((this.untilMs - this.now) / 1000));
  }
}

/**
 * A call whose worst case alone is over one of the tenant's limits: no period's end makes it fit, so the run
 * fails (at intake, a 422) instead of waiting for ever and holding its tenant's lane back.
 */
export class BudgetTooSmall extends GateRefused {
  constructor(
    readonly tenant: string,
    readonly budget: { period: "day" | "month"; unit: "usd" | "tokens"; limit: number },
    readonly worst: number,
  ) {
    super(
      `the run's worst case (${worst}${budget.unit === "usd" ? " USD" : " tokens"}: its prompt and every output ` +
        `token it may write) is over tenant ${tenant}'s whole budget per ${budget.period} ` +
        `(${budget.limit}${budget.unit === "usd" ? " USD" : " tokens"})`,
    );
    this.name = "BudgetTooSmall";
  }
}

/** A USD budget, but the model has no price: its calls cannot be bounded. */
export class ModelUnpriced extends GateRefused {
  constructor(readonly model: string, tenant: string) {
    super(`model ${model} has no price (LLM_PRICES) and tenant ${tenant} has a USD budget`);
    this.name = "ModelUnpriced";
  }
}

const money = (n: number) => Math.round(nanosToUsd(n) * 1e6) / 1e6;

/** The worst case is over a limit by itself: the refusal that no wait ends. */
function tooSmall(tenant: string, limits: Limits, worst: { tokens: number; nanos: number }): BudgetTooSmall {
  const i = limits.findIndex((limit, j) => limit >= 0 && (j % 2 === 0 ? worst.tokens : worst.nanos) > limit);
  const { period, unit } = BUDGETS[i]!;
  return new BudgetTooSmall(
    tenant,
    { period, unit, limit: unit === "usd" ? money(limits[i]!) : limits[i]! },
    unit === "usd" ? money(worst.nanos) : worst.tokens,
  );
}

/** The refusal of a budget the worst case does not fit now: `refusal.budget` is its index, 0..3. */
function exhausted(
  tenant: string,
  refusal: { budget: number; limit: number; spent: number; now: number },
  worst: { tokens: number; nanos: number },
): BudgetExhausted {
  const { period, unit } = BUDGETS[refusal.budget]!;
  return new BudgetExhausted(
    tenant,
    {
      period,
      unit,
      limit: unit === "usd" ? money(refusal.limit) : refusal.limit,
      spent: unit === "usd" ? money(refusal.spent) : refusal.spent,
    },
    periodEnd(period, refusal.now),
    refusal.now,
    worst,
  );
}

/**
 * The budget a worst case would pass, as the reserve script picks it: of those it would pass, the one whose period
 * ends last (so a wait names when it can fit again), 0..3; `never` when it is over a limit by itself. Without
 * `held` it is intake's question, which counts what is spent only; with it, what is reserved in flight counts too.
 */
export function overLimit(
  limits: Limits,
  spent: Limits,
  held: Limits | undefined,
  worst: { tokens: number; nanos: number },
): { budget: number; never: boolean } | undefined {
  let budget = -1;
  let never = false;
  limits.forEach((limit, i) => {
    const want = whole(i % 2 === 0 ? worst.tokens : worst.nanos);
    if (limit >= 0 && spent[i]! + (held?.[i] ?? 0) + want > limit) budget = i;
    if (limit >= 0 && want > limit) never = true;
  });
  return budget < 0 ? undefined : { budget, never };
}

/** What a budget reports, for metrics and logs. */
export interface BudgetEvents {
  /** After a settlement: the tenant's spend and reservations now, per budget. */
  state?(tenant: string, spent: Limits, reserved: Limits): void;
  /** A budget crossed 80% or reached 100% of its limit (once per period). */
  threshold?(tenant: string, budget: (typeof BUDGETS)[number], percent: 80 | 100): void;
  /** A reservation or an intake was refused. */
  refused?(tenant: string, where: "worker" | "intake"): void;
}

/** A reservation held for one call. */
export interface HeldReservation {
  /** Releases the reservation and charges what the call cost (see `charge.ts`). */
  settle(end: CallEnd): Promise<void>;
  /** The charge the settlement made, once settled. */
  readonly charged?: CallTokens & { nanos?: number };
}

/** The budgets of every tenant, as one process uses them. */
export interface Budgets {
  /** The tenant's limits (read again from Postgres at most every `ttlMs`). */
  of(tenant: string): Promise<TenantBudget | undefined>;
  /**
   * Reserves a call's worst case against the tenant's budgets. @returns undefined when the tenant has none.
   * @throws {BudgetExhausted} when it does not fit now; {@linkcode BudgetTooSmall} when it never can;
   * {@linkcode ModelUnpriced} for a USD budget and no price.
   */
  reserve(tenant: string, model: string, worst: CallTokens): Promise<HeldReservation | undefined>;
  /**
   * Intake's question: does a run's worst case still fit what the tenant has spent? @returns the refusal, if any:
   * spent for now ({@linkcode BudgetExhausted}), or never ({@linkcode BudgetTooSmall}).
   */
  check(tenant: string, model: string, worst: CallTokens): Promise<BudgetExhausted | BudgetTooSmall | undefined>;
  /**
   * Charges a call made without a reservation (a line of a provider batch, issue 43) at the model's price (its
   * batch price with `batch`), once per `id` however often it is asked (within an hour). The call's
   * `model_attempts` row must be written first: a hash lost and rebuilt from that record holds it already, and
   * nothing more is charged. Nothing without a budget or a price.
   */
  charge(tenant: string, model: string, used: CallTokens, options: { id: string; batch?: boolean }): Promise<void>;
  /**
   * Holds a batch line's worst case at the model's batch prices against the tenant's budgets, before its run is
   * recorded into a batch, until the line settles ({@linkcode settleHold}): a batch may take a day, so this is not
   * a call's reservation (those are charged whole after half an hour). Safe to ask again for the same `id` (the
   * run's id): it holds once. @returns what is held, or undefined when the tenant has no budget.
   * @throws {BudgetExhausted} when it does not fit now; {@linkcode BudgetTooSmall} when it never can;
   * {@linkcode ModelUnpriced} for a USD budget and no price; {@linkcode ReservationNotReplicated}.
   */
  hold(
    tenant: string,
    model: string,
    worst: CallTokens,
    id: string,
  ): Promise<{ tokens: number; nanos: number } | undefined>;
  /**
   * Settles a batch line's hold, once however often it is asked: the hold goes and `charged` (its reported usage at
   * batch prices; nothing for a line not answered) is spent. The line's `model_attempts` row must be written
   * first: a hash lost and rebuilt from the record counts a line with a row as spent, not held, and nothing more
   * is charged. A line that holds nothing (a tenant without a budget when it was collected) changes nothing.
   */
  settleHold(tenant: string, id: string, charged: { tokens: number; nanos: number }): Promise<void>;
  /**
   * Holds a line just recorded in a batch again if the tenant's hash lost its hold meanwhile (rebuilt from a
   * snapshot taken before the record's commit, or swept because no line was there yet), whether it fits or not: it
   * is in flight and will be charged. `held` is what {@linkcode hold} answered.
   */
  keepHold(tenant: string, id: string, held: { tokens: number; nanos: number }): Promise<void>;
  /**
   * Releases the holds no line in flight stands behind (a worker killed between the hold and the recording of its
   * run and the run cancelled before its redelivery, a line left out of its batch before the upload), as Postgres
   * says ({@linkcode BudgetRecords.holdVerdicts}). Looks at holds older than `olderThanMs` only (a run is recorded
   * within a moment of its hold; a renewed hold is younger) of the tenants with a budget. @returns how many it
   * released.
   */
  sweepHolds(options?: { olderThanMs?: number }): Promise<number>;
  /** The tenant's budgets now (none without a budget). */
  views(tenant: string): Promise<BudgetView[]>;
  /** Whether a blocked tenant's refused worst case fits again (the period ended, the budget was raised, calls settled). */
  fitsAgain(error: BudgetExhausted, model?: string): Promise<boolean>;
  /** Marks the tenant's runs as held back for its budget until `untilMs` (the worker holding them renews it). */
  markWaiting(tenant: string, untilMs: number): Promise<void>;
  /** Removes the mark: the tenant's runs go on. */
  clearWaiting(tenant: string): Promise<void>;
  /** Until when (epoch ms) the tenant's runs are marked held back for its budget; 0 when they are not. */
  waitingUntil(tenant: string): Promise<number>;
}

/** Options for {@linkcode createBudgets}. */
export interface BudgetsOptions {
  /** The name of each tenant's budget hash. */
  keys: BudgetKeys;
  /** The limits and the recorded spend, from the stores that own them. */
  records: BudgetRecords;
  prices: Prices;
  /** How long limits read from Postgres are used; default 2 s. */
  ttlMs?: number;
  events?: BudgetEvents;
}

/**
 * Runs a budget script, and again (at most twice more, 100 ms and 200 ms later) when Redis answers with an error: the
 * scripts are safe to run twice, and one whose reply was lost with its connection may have run.
 */
async function again<T>(run: () => Promise<T>): Promise<T> {
  for (let attempt = 1;; attempt++) {
    try {
      return await run();
    } catch (error) {
      if (attempt >= 3) throw error;
      await new Promise((resolve) => setTimeout(resolve, 100 * attempt));
    }
  }
}

/**
 * A reservation written on the primary that too few replicas acknowledged in time: it was released, and the call
 * does not go out (a failover could have lost it, and the call would then count against nothing).
 */
export class ReservationNotReplicated extends Error {
  constructor(readonly tenant: string) {
    super(`tenant ${tenant}'s budget reservation was not acknowledged by enough Redis replicas in time`);
    this.name = "ReservationNotReplicated";
  }
}

/** The field of a tenant's budget hash that says until when a worker holds the tenant's runs back. */
const WAITING_UNTIL = "waiting_until";

/** What one process's budgets share: its clients and options, the limits it read, and its own calls in flight. */
interface ProcessBudgets {
  redis: RedisClient;
  log: Logger;
  ack?: ReplicaAck;
  keys: BudgetKeys;
  records: BudgetRecords;
  prices: Prices;
  events: BudgetEvents;
  /** The tenant's limits (read again at most every `ttlMs`); undefined without any. */
  of(tenant: string): Promise<TenantBudget | undefined>;
  /**
   * This process's reservations of calls in flight, by tenant. A hash lost in Redis and rebuilt from Postgres's
   * record has none of them (the record has no calls in flight): they are held in it again (reinstated) as soon
   * as this process sees another incarnation of the hash, or seeds it.
   */
  inFlight: Map<string, Map<string, InFlight>>;
  /** The seed running for a tenant: one at a time, and every caller waits for it (see {@linkcode seed}). */
  seeding: Map<string, Promise<void>>;
  /** The holds the sweep found in flight, until it asks again (Redis's epoch ms). */
  liveHolds: Map<string, number>;
}

/**
 * Creates the budgets of one process. With `ack` (REDIS_MIN_REPLICAS_ACK > 0), every reservation and settlement
 * is followed by a WAIT in the same round trip, so a promoted replica has every one a call was made under.
 */
export function createBudgets(
  { redis, log, ack }: { redis: RedisClient; log: Logger; ack?: ReplicaAck },
  options: BudgetsOptions,
): Budgets {
  const { keys, records, prices } = options;
  const p: ProcessBudgets = {
    redis,
    log,
    ack,
    keys,
    records,
    prices,
    events: options.events ?? {},
    of: limitsReader(records, log, options.ttlMs ?? 2_000),
    inFlight: new Map(),
    seeding: new Map(),
    liveHolds: new Map(),
  };
  return {
    of: p.of,
    reserve: (tenant, model, worst) => reserve(p, tenant, model, worst),
    check: (tenant, model, worst) => check(p, tenant, model, worst),
    hold: (tenant, model, worst, id) => hold(p, tenant, model, worst, id),
    settleHold: (tenant, id, charged) => settleHold(p, tenant, id, charged),
    keepHold: (tenant, id, held) => keepHold(p, tenant, id, held),
    sweepHolds: (options) => sweepHolds(p, options),
    charge: (tenant, model, used, options) => chargeUnreserved(p, tenant, model, used, options),
    async views(tenant) {
      const budget = await p.of(tenant);
      return budget ? viewsOf(limitsOf(budget), await readSeeded(p, tenant)) : [];
    },
    async fitsAgain(error) {
      const budget = await p.of(error.tenant);
      if (!budget) return true;
      // What is spent leaves room; so must what is reserved in flight, or the run would be refused again at once.
      const state = await readSeeded(p, error.tenant);
      return overLimit(limitsOf(budget), state.spent, state.reserved, error.worst) === undefined;
    },
    async markWaiting(tenant, untilMs) {
      await redis.hset(keys.budget(tenant), WAITING_UNTIL, untilMs);
    },
    async clearWaiting(tenant) {
      await redis.hdel(keys.budget(tenant), WAITING_UNTIL);
    },
    async waitingUntil(tenant) {
      return Number(await redis.hget(keys.budget(tenant), WAITING_UNTIL));
    },
  };
}

/** Every tenant's limits, read again at most every `ttlMs`: a tenant's, or undefined when it has none. */
function limitsReader(
  records: BudgetRecords,
  log: Logger,
  ttlMs: number,
): (tenant: string) => Promise<TenantBudget | undefined> {
  let loaded: { at: number; budgets: Map<string, TenantBudget> } | undefined;
  let loading: Promise<Map<string, TenantBudget>> | undefined;
  async function all(): Promise<Map<string, TenantBudget>> {
    if (loaded && performance.now() - loaded.at < ttlMs) return loaded.budgets;
    loading ??= records.limits().then((budgets) => {
      loaded = { at: performance.now(), budgets };
      return budgets;
    }, (error) => {
      // Postgres unreachable: the last limits known stand (none known: the error goes to the caller).
      if (loaded) {
        log.warn("budgets_unreadable", { error });
        return loaded.budgets;
      }
      throw error;
    }).finally(() => loading = undefined);
    return await loading;
  }
  return async (tenant) => {
    const budget = (await all()).get(tenant);
    return hasBudget(budget) ? budget : undefined;
  };
}

/** A call's worst case in tokens and nano-dollars at the model's price. @throws {ModelUnpriced} for a USD budget. */
function worstOf(
  p: ProcessBudgets,
  tenant: string,
  budget: TenantBudget,
  model: string,
  worst: CallTokens,
  batch = false,
): { price: ModelPrice | undefined; held: { tokens: number; nanos: number } } {
  const price = p.prices.of(model);
  if (!price && (budget.usd_per_day !== undefined || budget.usd_per_month !== undefined)) {
    throw new ModelUnpriced(model, tenant);
  }
  const nanos = price ? costNanos(price, worst.prompt, worst.completion, batch) : 0;
  return { price, held: { tokens: worst.prompt + worst.completion, nanos } };
}

/** The incarnation this process's calls in flight for the tenant were reserved in ('' when none). */
function incOf(p: ProcessBudgets, tenant: string): string {
  const held = p.inFlight.get(tenant);
  if (!held) return "";
  for (const r of held.values()) return r.inc;
  return "";
}

/** Holds this process's calls in flight for the tenant again in its hash, unless they are all held in `inc`. */
async function reinstate(p: ProcessBudgets, tenant: string, inc?: string): Promise<void> {
  const held = p.inFlight.get(tenant);
  if (!held || held.size === 0) return;
  const items = [...held.values()];
  if (inc !== undefined && items.every((r) => r.inc === inc)) return;
  const after = await reinstateReservations(p.redis, p.keys.budget(tenant), items, { ack: p.ack });
  for (const r of items) r.inc = after.inc;
  if (after.added > 0) p.log.warn("budget_reservations_reinstated", { tenant, reservations: after.added });
}

/**
 * Rebuilds a tenant's budget state from Postgres's record when Redis lost it (a flush, a failover without
 * persistence, an eviction): its spend this day and month becomes what `model_attempts` recorded, never less
 * than what the hash holds. One seed per tenant at a time; every caller waits for it.
 */
function seed(p: ProcessBudgets, tenant: string): Promise<void> {
  let running = p.seeding.get(tenant);
  if (!running) {
    running = seedFromRecord(p, tenant, { rebuild: true })
      .then(() => p.log.info("budget_state_seeded", { tenant }))
      .then(() => reinstate(p, tenant))
      .finally(() => p.seeding.delete(tenant));
    p.seeding.set(tenant, running);
  }
  return running;
}

/** The tenant's budget state, after a seed if its hash was never seeded (lost again meanwhile: seeded again). */
async function readSeeded(p: ProcessBudgets, tenant: string): Promise<BudgetState> {
  const read = () => again(() => readBudgetState(p.redis, p.keys.budget(tenant)));
  let state = await read();
  for (let tries = 0; !state.seeded && tries < 3; tries++) {
    await seed(p, tenant);
    state = await read();
  }
  return state;
}

/** Releases a reservation (a settlement at nothing); a failure is logged, and the reservation is charged later. */
async function release(
  p: ProcessBudgets,
  tenant: string,
  at: { epoch: number; inc: string; id: string },
  held: { tokens: number; nanos: number },
  limits: Limits,
): Promise<void> {
  await again(() => runSettle(p.redis, p.keys.budget(tenant), at, held, { tokens: 0, nanos: 0 }, limits))
    .catch((error) => p.log.warn("budget_release_failed", { tenant, error }));
}

/** The reserve script, after a seed if the tenant's hash was never seeded. */
async function ask(
  p: ProcessBudgets,
  tenant: string,
  limits: Limits,
  worst: { tokens: number; nanos: number },
): Promise<ReserveReply> {
  const key = p.keys.budget(tenant);
  // One id for every try: an unseeded answer wrote nothing, and a resend of a try finds its own reservation.
  const id = crypto.randomUUID();
  try {
    // Lost again between the seed and the question (a flush in a loop): seeded again, a few times. A hash of
    // another incarnation than this process's calls in flight were reserved in holds them again first.
    for (let tries = 0; tries < 3; tries++) {
      const expectInc = incOf(p, tenant);
      const reply = await again(() =>
        runReserve(p.redis, key, limits, worst, { requireSeeded: true, id, ack: p.ack, expectInc })
      );
      if (reply.otherInc !== undefined) await reinstate(p, tenant);
      else if (reply.unseeded) await seed(p, tenant);
      else return reply;
    }
    return await again(() => runReserve(p.redis, key, limits, worst, { id, ack: p.ack }));
  } catch (error) {
    // The reserve may have run though its caller heard an error (a reply lost with its connection, or a command
    // ioredis aborted behind it in a pipeline): its id is released, or it would hold the budget for an epoch.
    await release(p, tenant, { epoch: 0, inc: "", id }, worst, limits);
    throw error;
  }
}

/** Logs a budget's 80% or 100% mark (once per period: the scripts decide) and reports it. */
function announce(
  p: ProcessBudgets,
  tenant: string,
  budget: number,
  percent: 80 | 100,
  shown: { limit: number; spent: number },
): void {
  const b = BUDGETS[budget]!;
  p.log[percent === 100 ? "warn" : "info"]("budget_reached", {
    tenant,
    period: b.period,
    unit: b.unit,
    percent,
    limit: shown.limit,
    spent: shown.spent,
  });
  p.events.threshold?.(tenant, b, percent);
}

/** Reports a settlement: the tenant's spend and reservations now, and the 80% and 100% marks it crossed first. */
function reportSettled(
  p: ProcessBudgets,
  tenant: string,
  limits: Limits,
  after: { spent: Limits; reserved: Limits; marks: { budget: number; percent: 80 | 100 }[] },
): void {
  p.events.state?.(tenant, after.spent, after.reserved);
  for (const { budget: i, percent } of after.marks) {
    const usd = BUDGETS[i]!.unit === "usd";
    const show = (n: number) => usd ? nanosToUsd(n) : n;
    announce(p, tenant, i, percent, { limit: show(limits[i]!), spent: show(after.spent[i]!) });
  }
}

/** Reserves a call's worst case (see {@linkcode Budgets.reserve}). */
async function reserve(
  p: ProcessBudgets,
  tenant: string,
  model: string,
  worst: CallTokens,
): Promise<HeldReservation | undefined> {
  const budget = await p.of(tenant);
  if (!budget) return undefined;
  const { price, held } = worstOf(p, tenant, budget, model, worst);
  const limits = limitsOf(budget);
  const reply = await ask(p, tenant, limits, held);
  if (!reply.ok && reply.never) throw tooSmall(tenant, limits, held);
  if (!reply.ok) {
    p.events.refused?.(tenant, "worker");
    const error = exhausted(tenant, reply, held);
    for (const percent of reply.newly) announce(p, tenant, reply.budget, percent, error.budget);
    throw error;
  }
  if (!reply.replicated) {
    // Released at once (a settle at nothing); should that too be lost in a failover, the reservation is
    // charged whole when its epoch ends: never less than what may have run.
    await release(p, tenant, reply, held, limits);
    throw new ReservationNotReplicated(tenant);
  }
  const own: InFlight = { id: reply.id, tok: held.tokens, usd: held.nanos, inc: reply.inc };
  let mine = p.inFlight.get(tenant);
  if (!mine) p.inFlight.set(tenant, mine = new Map());
  mine.set(own.id, own);
  let charged: (CallTokens & { nanos?: number }) | undefined;
  return {
    get charged() {
      return charged;
    },
    async settle(end) {
      const charge = chargeOf(end, worst);
      const nanos = price ? costNanos(price, charge.prompt, charge.completion) : 0;
      charged = { prompt: charge.prompt, completion: charge.completion, ...(price ? { nanos } : {}) };
      // The call is over: no longer this process's to reinstate, whether this settlement lands or not (one that
      // never does leaves the reservation to be charged whole when its epoch ends).
      const mine = p.inFlight.get(tenant);
      mine?.delete(own.id);
      if (mine?.size === 0) p.inFlight.delete(tenant);
      await settle(p, tenant, { own, epoch: reply.epoch, held, limits }, {
        tokens: charge.prompt + charge.completion,
        nanos,
      });
    },
  };
}

/** Settles a call's reservation at its charge: after a seed if the hash was lost, and reports where it stands. */
async function settle(
  p: ProcessBudgets,
  tenant: string,
  call: { own: InFlight; epoch: number; held: { tokens: number; nanos: number }; limits: Limits },
  charge: { tokens: number; nanos: number },
): Promise<void> {
  const { own, limits } = call;
  const at = () => ({ epoch: call.epoch, inc: own.inc, id: own.id });
  const run = () => runSettle(p.redis, p.keys.budget(tenant), at(), call.held, charge, limits, { ack: p.ack });
  let after = await run();
  // The hash was lost: seeded from the record first (which has no row of this call yet), then charged.
  for (let tries = 0; after.unseeded && tries < 3; tries++) {
    await seed(p, tenant);
    after = await run();
  }
  if (after.unseeded) return p.log.warn("budget_settle_unseeded", { tenant });
  if (!after.replicated) p.log.warn("budget_settle_not_replicated", { tenant });
  // The hash was lost and rebuilt since this call was reserved: this process's other calls are held again.
  if (after.inc !== own.inc) {
    await reinstate(p, tenant, after.inc).catch((error) => p.log.warn("budget_reinstate_failed", { tenant, error }));
  }
  reportSettled(p, tenant, limits, after);
}

/**
 * The incarnation a charge without a reservation names: never a hash's own (those are random ids), so the settle
 * script takes its id as unknown to this hash, spends the charge, and records the id (`D:<id>`) so that a second
 * charge of it does nothing.
 */
const UNRESERVED_INC = "unreserved";

/** Charges a call made without a reservation (see {@linkcode Budgets.charge}). */
async function chargeUnreserved(
  p: ProcessBudgets,
  tenant: string,
  model: string,
  used: CallTokens,
  { id, batch = false }: { id: string; batch?: boolean },
): Promise<void> {
  const budget = await p.of(tenant);
  if (!budget) return;
  const price = p.prices.of(model);
  const limits = limitsOf(budget);
  const nanos = price ? costNanos(price, used.prompt, used.completion, batch) : 0;
  const at = { epoch: Math.floor(Date.now() / RESERVATION_EPOCH_MS), inc: UNRESERVED_INC, id: `u:${id}` };
  const charge = { tokens: used.prompt + used.completion, nanos };
  const run = (amount: { tokens: number; nanos: number }) =>
    again(() => runSettle(p.redis, p.keys.budget(tenant), at, { tokens: 0, nanos: 0 }, amount, limits, { ack: p.ack }));
  const after = await run(charge);
  if (after.unseeded) {
    // Lost: rebuilt from the record, which holds this call's row already (the caller wrote it first). The id is
    // then recorded at a charge of nothing, so that a second charge of it (a line read again) adds nothing either.
    await seed(p, tenant);
    await run({ tokens: 0, nanos: 0 });
    return;
  }
  if (!after.applied) return;
  reportSettled(p, tenant, limits, after);
}

/** Holds a batch line's worst case (see {@linkcode Budgets.hold}). */
async function hold(
  p: ProcessBudgets,
  tenant: string,
  model: string,
  worst: CallTokens,
  id: string,
): Promise<{ tokens: number; nanos: number } | undefined> {
  const budget = await p.of(tenant);
  if (!budget) return undefined;
  const { held } = worstOf(p, tenant, budget, model, worst, true);
  const limits = limitsOf(budget);
  const key = p.keys.budget(tenant);
  let reply = await again(() => runHold(p.redis, key, limits, held, { id, ack: p.ack }));
  for (let tries = 0; reply.unseeded && tries < 3; tries++) {
    await seed(p, tenant);
    reply = await again(() => runHold(p.redis, key, limits, held, { id, ack: p.ack }));
  }
  if (reply.unseeded) throw new Error(`tenant ${tenant}'s budget hash was lost again each time it was seeded`);
  if (!reply.ok && reply.never) throw tooSmall(tenant, limits, held);
  if (!reply.ok) {
    p.events.refused?.(tenant, "worker");
    throw exhausted(tenant, reply, held);
  }
  if (!reply.replicated) {
    // Released at once; should that be lost too, the sweep finds a hold with no line behind it and releases it.
    await settleHold(p, tenant, id, { tokens: 0, nanos: 0 }).catch(() => {});
    throw new ReservationNotReplicated(tenant);
  }
  return held;
}

/** Settles a batch line's hold (see {@linkcode Budgets.settleHold}): after a seed when the hash was lost. */
async function settleHold(
  p: ProcessBudgets,
  tenant: string,
  id: string,
  charged: { tokens: number; nanos: number },
  at?: number,
): Promise<void> {
  const budget = await p.of(tenant);
  const limits: Limits = budget ? limitsOf(budget) : [-1, -1, -1, -1];
  const key = p.keys.budget(tenant);
  const run = () => again(() => runSettleHold(p.redis, key, id, charged, limits, { ack: p.ack, at }));
  let after = await run();
  // Lost: a tenant with a budget has its hash rebuilt (with this line's hold if it is still in flight and not yet
  // charged in the record), then is asked again; without one, nothing holds anything.
  for (let tries = 0; after.unseeded && budget && tries < 3; tries++) {
    await seed(p, tenant);
    after = await run();
  }
  if (after.unseeded && budget) {
    throw new Error(`tenant ${tenant}'s budget hash was lost again each time it was seeded`);
  }
  if (!after.applied) return;
  if (!after.replicated) p.log.warn("budget_settle_not_replicated", { tenant });
  reportSettled(p, tenant, limits, after);
}

/** Holds a recorded line again if its hold is gone (see {@linkcode Budgets.keepHold}). */
async function keepHold(
  p: ProcessBudgets,
  tenant: string,
  id: string,
  held: { tokens: number; nanos: number },
): Promise<void> {
  const key = p.keys.budget(tenant);
  const run = () => again(() => runHold(p.redis, key, [-1, -1, -1, -1], held, { id, keep: true, ack: p.ack }));
  let reply = await run();
  for (let tries = 0; reply.unseeded && tries < 3; tries++) {
    // Lost: the rebuild reads the line (committed now) as held, and the keep then finds it.
    await seed(p, tenant);
    reply = await run();
  }
}

/** How long the sweep trusts that a line it found in flight still is, before it asks Postgres again. */
const LIVE_RECHECK_MS = 30 * 60_000;

/** The holds' sweep (see {@linkcode Budgets.sweepHolds}). */
async function sweepHolds(p: ProcessBudgets, { olderThanMs = 10 * 60_000 } = {}): Promise<number> {
  const verdicts = p.records.holdVerdicts?.bind(p.records);
  if (!verdicts) return 0;
  const tenants = [...(await p.records.limits()).keys()];
  // Redis's clock: a hold's time is Redis's.
  const [seconds, micros] = await p.redis.time();
  const now = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
  for (const [id, until] of p.liveHolds) if (until <= now) p.liveHolds.delete(id);
  // From a random tenant on, so that a tenant whose hash fails every pass does not hold back the ones after it.
  const from = Math.floor(Math.random() * tenants.length);
  let released = 0;
  for (let i = 0; i < tenants.length; i += 100) {
    const chunk = Array.from(
      { length: Math.min(100, tenants.length - i) },
      (_, j) => tenants[(from + i + j) % tenants.length]!,
    );
    await Promise.all(chunk.map(async (tenant) => {
      try {
        const old = (await heldIn(p.redis, p.keys.budget(tenant)))
          .filter((h) => h.atMs < now - olderThanMs && !p.liveHolds.has(h.id));
        if (old.length === 0) return;
        const found = await verdicts(old.map((h) => h.id));
        for (const h of old) {
          if (found.get(h.id)?.live) {
            p.liveHolds.set(h.id, now + LIVE_RECHECK_MS);
            continue;
          }
          // Only the hold as read: one renewed since (a redelivery, the line just recorded) is left.
          await settleHold(p, tenant, h.id, { tokens: 0, nanos: 0 }, h.atMs);
          released++;
          p.log.info("budget_hold_swept", { tenant, run_id: h.id, tokens: h.tokens, nanos: h.nanos });
        }
      } catch (error) {
        p.log.warn("budget_hold_sweep_failed", { tenant, error });
      }
    }));
  }
  return released;
}

/** Intake's question (see {@linkcode Budgets.check}): reservations in flight aside, does the worst case fit? */
async function check(
  p: ProcessBudgets,
  tenant: string,
  model: string,
  worst: CallTokens,
): Promise<BudgetExhausted | BudgetTooSmall | undefined> {
  const budget = await p.of(tenant);
  if (!budget) return undefined;
  const { held } = worstOf(p, tenant, budget, model, worst);
  const limits = limitsOf(budget);
  const state = await readSeeded(p, tenant);
  const over = overLimit(limits, state.spent, undefined, held);
  if (!over) return undefined;
  if (over.never) return tooSmall(tenant, limits, held);
  p.events.refused?.(tenant, "intake");
  const i = over.budget;
  return exhausted(tenant, { budget: i, limit: limits[i]!, spent: state.spent[i]!, now: state.now }, held);
}

/** The budgets with a limit, as the API shows them (USD as dollars). */
export function viewsOf(limits: Limits, state: BudgetState): BudgetView[] {
  const views: BudgetView[] = [];
  limits.forEach((limit, i) => {
    if (limit < 0) return;
    const { period, unit } = BUDGETS[i]!;
    const show = (n: number) => unit === "usd" ? nanosToUsd(n) : n;
    views.push({
      period,
      unit,
      limit: show(limit),
      spent: show(state.spent[i]!),
      reserved: show(state.reserved[i]!),
      resets_at: new Date(periodEnd(period, state.now)).toISOString(),
    });
  });
  return views;
}

/**
 * The tenant's budgets as its hash holds them now, for a tool that only looks (nothing is seeded); without
 * `redis`, the limits with nothing spent.
 */
export async function currentViews(
  { redis, keys }: { redis?: RedisClient; keys: BudgetKeys },
  tenant: string,
  budget: TenantBudget,
): Promise<BudgetView[]> {
  const state: BudgetState = redis ? await readBudgetState(redis, keys.budget(tenant)) : {
    now: Date.now(),
    day: 0,
    month: 0,
    spent: [0, 0, 0, 0],
    reserved: [0, 0, 0, 0],
    seeded: false,
  };
  return viewsOf(limitsOf(budget), state);
}

/**
 * Raises the tenant's current spend in Redis to what Postgres recorded (a budget set mid-period, a hash lost):
 * each call at what it was charged (`model_attempts.charged_tokens`, `cost_usd`), so a call charged its
 * reservation counts its reservation, not 0.
 */
export async function seedFromRecord(
  { redis, keys, records }: { redis: RedisClient; keys: BudgetKeys; records: Pick<BudgetRecords, "spent"> },
  tenant: string,
  { rebuild = false }: {
    /** The hash was found lost: one seeded by another process meanwhile is left as it is (see the seed script). */
    rebuild?: boolean;
  } = {},
): Promise<void> {
  const { day, month, holds } = await records.spent(tenant);
  const nanos = (usd: number) => Math.ceil(usd * 1e9);
  const spent: Limits = [day.tokens, nanos(day.usd), month.tokens, nanos(month.usd)];
  await seedBudgetState(redis, keys.budget(tenant), spent, { holds, rebuild });
}

/**
 * At start-up: names every model in use (every model served, the default among them, and every task's) that has no
 * price while some tenant has a USD budget. Such a model's runs of those tenants fail (their cost could not be
 * bounded).
 */
export async function warnUnpricedModels(
  { log, records, taskModels }: {
    log: Logger;
    records: Pick<BudgetRecords, "limits">;
    /** Every model a task names (the task store, from its `model` column: no definition is read). */
    taskModels: () => Promise<string[]>;
  },
  config: Parameters<typeof servedModels>[0],
  prices: Prices,
): Promise<string[]> {
  const budgets = await records.limits();
  const usd = [...budgets].filter(([, b]) => b.usd_per_day !== undefined || b.usd_per_month !== undefined);
  if (usd.length === 0) return [];
  // With LLM_DEPLOYMENTS any model a deployment lists may be asked for, so each needs a price.
  const models = new Set([...servedModels(config), ...await taskModels()]);
  const missing = [...models].filter((model) => !prices.of(model)).sort();
  if (missing.length > 0) {
    log.error("budget_models_unpriced", {
      models: missing,
      tenants: usd.map(([name]) => name).slice(0, 20),
      detail: "these models have no price in LLM_PRICES (or LLM_PRICE_IN/OUT_PER_MTOK) while tenants have USD " +
        "budgets: those tenants' runs on them fail until a price is set",
    });
  }
  return missing;
}
