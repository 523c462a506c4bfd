/**
 * Tenant budgets: limits in USD and tokens per UTC day and month, kept in
 * Postgres (`tenant budget`), enforced in Redis (see `budget_scripts.ts`).
 *
 * Every process reads the limits of the tenants that have any (one small
 * query, at most every `ttlMs`), so a raised budget takes effect within
 * seconds without a restart; a tenant without a budget costs no Redis round
 * trip at all. Before each model call a worker reserves the call's worst
 * case (see {@linkcode worstCaseTokens}) against every budget and settles it
 * at the charge afterwards (see `charge.ts`); intake refuses a run whose
 * worst case no longer fits what is spent.
 */
import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import type { BudgetView } from "../usage/usage_schemas.ts";
import { GateRefused } from "../retry/errors.ts";
import { type CallEnd, type CallTokens, chargeOf } from "./charge.ts";
import { costNanos, type ModelPrice, nanosToUsd, type Prices, usdToNanos } from "../llm/prices.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import { taskModels } from "../jobs/task_store.ts";
import {
  type BudgetState,
  type InFlight,
  type Limits,
  readBudgetState,
  reinstateReservations,
  type ReserveReply,
  runReserve,
  runSettle,
  seedBudgetState,
} from "./budget_scripts.ts";

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

/** One budget as `GET /v1/usage`, `tenant list` and the console show it: the usage document's schema is its one definition. */
export type { BudgetView };

/** The Redis key of a tenant's budget state: under the tenant's lane tag, so in its lane's slot. */
export function budgetKey(prefix: string, tenant: string): string {
  return `${prefix}:{t:${tenant}}:budget`;
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

function exhausted(tenant: string, reply: ReserveReply, worst: { tokens: number; nanos: number }): BudgetExhausted {
  const { period, unit } = BUDGETS[reply.budget]!;
  return new BudgetExhausted(
    tenant,
    {
      period,
      unit,
      limit: unit === "usd" ? money(reply.limit) : reply.limit,
      spent: unit === "usd" ? money(reply.spent) : reply.spent,
    },
    periodEnd(period, reply.now),
    reply.now,
    worst,
  );
}

/** Reads every tenant's limits from Postgres. */
export async function loadBudgets(sql: Sql): Promise<Map<string, TenantBudget>> {
  const rows = await sql<
    {
      name: string;
      usd_day: string | null;
      usd_month: string | null;
      tok_day: string | null;
      tok_month: string | null;
    }[]
  >`
    SELECT name, budget_usd_day::text AS usd_day, budget_usd_month::text AS usd_month,
      budget_tokens_day::text AS tok_day, budget_tokens_month::text AS tok_month
    FROM tenants
    WHERE budget_usd_day IS NOT NULL OR budget_usd_month IS NOT NULL
      OR budget_tokens_day IS NOT NULL OR budget_tokens_month IS NOT NULL`;
  const num = (v: string | null) => v === null ? undefined : Number(v);
  return new Map(rows.map((r) => [r.name, {
    ...(r.usd_day === null ? {} : { usd_per_day: num(r.usd_day) }),
    ...(r.usd_month === null ? {} : { usd_per_month: num(r.usd_month) }),
    ...(r.tok_day === null ? {} : { tokens_per_day: num(r.tok_day) }),
    ...(r.tok_month === null ? {} : { tokens_per_month: num(r.tok_month) }),
  }]));
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
  /** The tenant's budgets now (none without a budget). */
  views(tenant: string): Promise<BudgetView[]>;
  /** Whether a blocked tenant's refused worst case fits again (the period ended, the budget was raised, calls settled). */
  fitsAgain(error: BudgetExhausted, model?: string): Promise<boolean>;
}

/** Options for {@linkcode createBudgets}. */
export interface BudgetsOptions {
  prefix: string;
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

/**
 * Creates the budgets of one process. With `ack` (REDIS_MIN_REPLICAS_ACK > 0), every reservation and settlement
 * is followed by a WAIT in the same round trip, so a promoted replica has every one a call was made under.
 */
export function createBudgets(
  { redis, sql, log, ack }: { redis: RedisClient; sql: Sql; log: Logger; ack?: ReplicaAck },
  options: BudgetsOptions,
): Budgets {
  const ttlMs = options.ttlMs ?? 2_000;
  const events = options.events ?? {};
  let loaded: { at: number; budgets: Map<string, TenantBudget> } | undefined;
  let loading: Promise<Map<string, TenantBudget>> | undefined;

  async function all(): Promise<Map<string, TenantBudget>> {
    if (loaded && performance.now() - loaded.at < ttlMs) return loaded.budgets;
    loading ??= loadBudgets(sql).then((budgets) => {
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

  async function of(tenant: string) {
    const budget = (await all()).get(tenant);
    return hasBudget(budget) ? budget : undefined;
  }

  function priceFor(tenant: string, budget: TenantBudget, model: string): ModelPrice | undefined {
    const price = options.prices.of(model);
    if (!price && (budget.usd_per_day !== undefined || budget.usd_per_month !== undefined)) {
      throw new ModelUnpriced(model, tenant);
    }
    return price;
  }

  const key = (tenant: string) => budgetKey(options.prefix, tenant);
  /**
   * This process's reservations of calls in flight, by tenant. A hash lost in Redis and rebuilt from Postgres's
   * record has none of them (the record has no calls in flight): they are held in it again (reinstated) as soon
   * as this process sees another incarnation of the hash, or seeds it.
   */
  const inFlight = new Map<string, Map<string, InFlight>>();
  /** The incarnation this process's calls in flight for the tenant were reserved in ('' when none). */
  const incOf = (tenant: string) => {
    const held = inFlight.get(tenant);
    if (!held) return "";
    for (const r of held.values()) return r.inc;
    return "";
  };
  const reinstate = async (tenant: string, inc?: string) => {
    const held = inFlight.get(tenant);
    if (!held || held.size === 0) return;
    const items = [...held.values()];
    if (inc !== undefined && items.every((r) => r.inc === inc)) return;
    const after = await reinstateReservations(redis, key(tenant), items, { ack });
    for (const r of items) r.inc = after.inc;
    if (after.added > 0) log.warn("budget_reservations_reinstated", { tenant, reservations: after.added });
  };
  /**
   * Rebuilds a tenant's budget state from Postgres's record when Redis lost it (a flush, a failover without
   * persistence, an eviction): its spend this day and month becomes what `model_attempts` recorded, never less
   * than what the hash holds. One seed per tenant at a time; every caller waits for it.
   */
  const seeding = new Map<string, Promise<void>>();
  const seed = (tenant: string) => {
    let running = seeding.get(tenant);
    if (!running) {
      running = seedFromRecord(redis, sql, options.prefix, tenant)
        .then(() => log.info("budget_state_seeded", { tenant }))
        .then(() => reinstate(tenant))
        .finally(() => seeding.delete(tenant));
      seeding.set(tenant, running);
    }
    return running;
  };
  /** The reserve script, after a seed if the tenant's hash was never seeded. */
  const ask = async (
    tenant: string,
    limits: Limits,
    worst: { tokens: number; nanos: number },
    mode: "reserve" | "check",
  ) => {
    // One id for every try: an unseeded answer wrote nothing, and a resend of a try finds its own reservation.
    const id = mode === "reserve" ? crypto.randomUUID() : "";
    try {
      // Lost again between the seed and the question (a flush in a loop): seeded again, a few times. A hash of
      // another incarnation than this process's calls in flight were reserved in holds them again first.
      for (let tries = 0; tries < 3; tries++) {
        const expectInc = mode === "reserve" ? incOf(tenant) : "";
        const reply = await again(() =>
          runReserve(redis, key(tenant), limits, worst, mode, { requireSeeded: true, id, ack, expectInc })
        );
        if (reply.otherInc !== undefined) await reinstate(tenant);
        else if (reply.unseeded) await seed(tenant);
        else return reply;
      }
      return await again(() => runReserve(redis, key(tenant), limits, worst, mode, { id, ack }));
    } catch (error) {
      // The reserve may have run though its caller heard an error (a reply lost with its connection, or a command
      // ioredis aborted behind it in a pipeline): its id is released, or it would hold the budget for an epoch.
      if (mode === "reserve") {
        await again(() =>
          runSettle(redis, key(tenant), { epoch: 0, inc: "", id }, worst, { tokens: 0, nanos: 0 }, limits)
        )
          .catch((release) => log.warn("budget_release_failed", { tenant, error: release }));
      }
      throw error;
    }
  };

  return {
    of,
    async reserve(tenant, model, worst) {
      const budget = await of(tenant);
      if (!budget) return undefined;
      const price = priceFor(tenant, budget, model);
      const limits = limitsOf(budget);
      const held = {
        tokens: worst.prompt + worst.completion,
        nanos: price ? costNanos(price, worst.prompt, worst.completion) : 0,
      };
      const reply = await ask(tenant, limits, held, "reserve");
      if (!reply.ok && reply.never) throw tooSmall(tenant, limits, held);
      if (!reply.ok) {
        events.refused?.(tenant, "worker");
        const error = exhausted(tenant, reply, held);
        for (const percent of reply.newly) {
          log[percent === 100 ? "warn" : "info"]("budget_reached", {
            tenant,
            period: error.budget.period,
            unit: error.budget.unit,
            percent,
            limit: error.budget.limit,
            spent: error.budget.spent,
          });
          events.threshold?.(tenant, BUDGETS[reply.budget]!, percent);
        }
        throw error;
      }
      const own = { id: reply.id, tok: held.tokens, usd: held.nanos, inc: reply.inc };
      if (!reply.replicated) {
        // Released at once (a settle at nothing); should that too be lost in a failover, the reservation is
        // charged whole when its epoch ends: never less than what may have run.
        await again(() => runSettle(redis, key(tenant), reply, held, { tokens: 0, nanos: 0 }, limits)).catch((error) =>
          log.warn("budget_release_failed", { tenant, error })
        );
        throw new ReservationNotReplicated(tenant);
      }
      let mine = inFlight.get(tenant);
      if (!mine) inFlight.set(tenant, mine = new Map());
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
          const mine = inFlight.get(tenant);
          mine?.delete(own.id);
          if (mine?.size === 0) inFlight.delete(tenant);
          const settle = () =>
            runSettle(
              redis,
              key(tenant),
              { epoch: reply.epoch, inc: own.inc, id: own.id },
              held,
              { tokens: charge.prompt + charge.completion, nanos },
              limits,
              { ack },
            );
          let after = await settle();
          // The hash was lost: seeded from the record first (which has no row of this call yet), then charged.
          for (let tries = 0; after.unseeded && tries < 3; tries++) {
            await seed(tenant);
            after = await settle();
          }
          if (after.unseeded) return log.warn("budget_settle_unseeded", { tenant });
          if (!after.replicated) log.warn("budget_settle_not_replicated", { tenant });
          // The hash was lost and rebuilt since this call was reserved: this process's other calls are held again.
          if (after.inc !== own.inc) {
            await reinstate(tenant, after.inc).catch((error) => log.warn("budget_reinstate_failed", { tenant, error }));
          }
          events.state?.(tenant, after.spent, after.reserved);
          for (const { budget: i, percent } of after.marks) {
            const b = BUDGETS[i]!;
            const limit = limits[i]!;
            log[percent === 100 ? "warn" : "info"]("budget_reached", {
              tenant,
              period: b.period,
              unit: b.unit,
              percent,
              limit: b.unit === "usd" ? nanosToUsd(limit) : limit,
              spent: b.unit === "usd" ? nanosToUsd(after.spent[i]!) : after.spent[i],
            });
            events.threshold?.(tenant, b, percent);
          }
        },
      };
    },
    async check(tenant, model, worst) {
      const budget = await of(tenant);
      if (!budget) return undefined;
      const price = priceFor(tenant, budget, model);
      const held = {
        tokens: worst.prompt + worst.completion,
        nanos: price ? costNanos(price, worst.prompt, worst.completion) : 0,
      };
      const reply = await ask(tenant, limitsOf(budget), held, "check");
      if (reply.ok) return undefined;
      if (reply.never) return tooSmall(tenant, limitsOf(budget), held);
      events.refused?.(tenant, "intake");
      return exhausted(tenant, reply, held);
    },
    async views(tenant) {
      const budget = await of(tenant);
      if (!budget) return [];
      let state = await readBudgetState(redis, key(tenant));
      if (!state.seeded) {
        await seed(tenant);
        state = await readBudgetState(redis, key(tenant));
      }
      return viewsOf(limitsOf(budget), state);
    },
    async fitsAgain(error) {
      const budget = await of(error.tenant);
      if (!budget) return true;
      const reply = await ask(error.tenant, limitsOf(budget), error.worst, "check");
      if (!reply.ok) return false;
      // What is spent leaves room; so must what is reserved in flight, or the run would be refused again at once.
      const state = await readBudgetState(redis, key(error.tenant));
      const limits = limitsOf(budget);
      return limits.every((limit, i) => {
        if (limit < 0) return true;
        const want = i % 2 === 0 ? error.worst.tokens : error.worst.nanos;
        return state.spent[i]! + state.reserved[i]! + want <= limit;
      });
    },
  };
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
 * Raises the tenant's current spend in Redis to what `model_attempts` recorded (a budget set mid-period, a hash
 * lost): each call at what it was charged (`charged_tokens`, `cost_usd`), so a call charged its reservation counts
 * its reservation, not 0.
 */
export async function seedFromRecord(redis: RedisClient, sql: Sql, prefix: string, tenant: string): Promise<void> {
  const [row] = await sql<{ day_tok: string; day_usd: string; month_tok: string; month_usd: string }[]>`
    SELECT
      COALESCE(sum(COALESCE(charged_tokens, COALESCE(prompt_tokens, 0) + COALESCE(completion_tokens, 0)))
        FILTER (WHERE started_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'), 0)::text AS day_tok,
      COALESCE(sum(cost_usd) FILTER (WHERE started_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'), 0)::text AS day_usd,
      COALESCE(sum(COALESCE(charged_tokens, COALESCE(prompt_tokens, 0) + COALESCE(completion_tokens, 0))), 0)::text AS month_tok,
      COALESCE(sum(cost_usd), 0)::text AS month_usd
    FROM model_attempts
    WHERE tenant = ${tenant}
      AND started_at >= date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'`;
  const usd = (v: string) => Math.ceil(Number(v) * 1e9);
  await seedBudgetState(redis, budgetKey(prefix, tenant), [
    Number(row!.day_tok),
    usd(row!.day_usd),
    Number(row!.month_tok),
    usd(row!.month_usd),
  ]);
}

/**
 * At start-up: names every model in use (the default and every task's) that has no price while some tenant
 * has a USD budget. Such a model's runs of those tenants fail (their cost could not be bounded).
 */
export async function warnUnpricedModels(
  { sql, log }: { sql: Sql; log: Logger },
  config: { OPENAI_MODEL: string; LLM_PROVIDER: string },
  prices: Prices,
): Promise<string[]> {
  const budgets = await loadBudgets(sql);
  const usd = [...budgets].filter(([, b]) => b.usd_per_day !== undefined || b.usd_per_month !== undefined);
  if (usd.length === 0) return [];
  // From the tasks' `model` column: no definition is read (each may be 256 KiB).
  const models = new Set([
    config.LLM_PROVIDER === "openai" ? config.OPENAI_MODEL : "extractive",
    ...await taskModels(sql),
  ]);
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
