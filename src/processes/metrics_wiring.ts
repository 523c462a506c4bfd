/**
 * The app's metrics, wired: the events of the worker, the relay, the model
 * calls, flow control and the result cache fed to the counters of
 * `metrics/metrics.ts`, and the gauges read on scrape (the queue's lanes, the
 * outbox backlog, the provider's breaker). The processes install them.
 */
import type { RedisClient } from "../clients.ts";
import type { Sql } from "postgres";
import { Gauge, type Registry } from "prom-client";
import type { RelayEvents } from "../outbox/relay.ts";
import { outboxBacklog } from "../outbox/outbox_store.ts";
import type { ServiceKeys } from "../runs/keys.ts";
import { type BacklogMonitor, type BacklogSnapshot, createBacklogMonitor } from "../queue/backlog.ts";
import type { Logger } from "../log/logger.ts";
import type { WorkerEvents } from "../queue/stream_worker.ts";
import type { AttemptReport } from "../retry/retry_policy.ts";
import type { FlowEvents, ProviderFlow } from "../provider/flow_control.ts";
import { type RelayMetrics, scrapeGauge, type WorkerMetrics } from "../metrics/metrics.ts";
import type { ResultCacheMetrics } from "../metrics/metrics.ts";
import type { ResultCacheEvents } from "../cache/result_cache.ts";

/**
 * Worker events that feed the worker metrics. With `concurrency` (WORKER_CONCURRENCY), the free slots are its
 * complement of the handlers in flight, all free from the start.
 */
export function workerEvents(m: WorkerMetrics, { concurrency }: { concurrency?: number } = {}): WorkerEvents {
  if (concurrency !== undefined) m.freeSlots.set(concurrency);
  return {
    delivered: (_msg, source) => m.deliveries.inc({ source }),
    acked: () => m.acked.inc(),
    failed: () => m.failures.inc(),
    deadLettered: () => m.deadLetters.inc(),
    deadLettersTrimmed: (n) => m.deadLettersDropped.inc(n),
    inFlight: (n) => {
      m.inFlight.set(n);
      if (concurrency !== undefined) m.freeSlots.set(Math.max(0, concurrency - n));
    },
  };
}

/** Model-attempt reports that feed the worker metrics. */
export function attemptObserver(m: WorkerMetrics): (report: AttemptReport) => void {
  return (report) => {
    m.modelAttempts.inc({ outcome: report.outcome });
    if (report.duration_ms > 0) m.modelDuration.observe({ outcome: report.outcome }, report.duration_ms / 1000);
    if (report.outcome === "retry") m.modelRetries.inc({ reason: report.reason ?? "unknown" });
    if (report.outcome === "deadline") m.deadlineExpiries.inc();
  };
}

/** How many tenants `oncely_queue_depth` names; the others are summed as `tenant="other"`. */
export const QUEUE_DEPTH_TENANTS = 20;

/**
 * The queue's gauges over every lane, read on scrape from the backlog's snapshot (`queue/backlog.ts`): one Redis
 * command a scrape, however many lanes there are (a scrape used to walk every lane: six commands a lane). The
 * snapshot covers the lanes with work and is at most one walk interval and one walk old
 * (`oncely_queue_snapshot_age_seconds`). Installed once per registry (`dev`'s components share one).
 */
export function queueGauges(
  registry: Registry,
  backlog: { read(): Promise<BacklogSnapshot | undefined> },
  { now = Date.now }: { now?: () => number } = {},
): void {
  if (registry.getSingleMetric("oncely_queue_waiting")) return;
  // One read serves every gauge of a scrape: prom-client starts their collects together, so they share the read
  // in flight.
  let inFlight: Promise<BacklogSnapshot | undefined> | undefined;
  const read = () => {
    if (!inFlight) {
      const value = backlog.read();
      inFlight = value;
      const done = () => {
        if (inFlight === value) inFlight = undefined;
      };
      value.then(done, done);
    }
    return inFlight;
  };
  const fromSnapshot = (name: string, help: string, value: (s: BacklogSnapshot | undefined) => number) =>
    new Gauge({
      name,
      help,
      registers: [registry],
      async collect() {
        try {
          this.set(value(await read()));
        } catch {
          // A failed read leaves the last value; /metrics must still answer.
        }
      },
    });
  fromSnapshot(
    "oncely_queue_waiting",
    "Runs waiting over all lanes: queued and not yet delivered to a worker (from the backlog's last walk).",
    (s) => s?.waiting ?? 0,
  );
  fromSnapshot(
    "oncely_queue_oldest_waiting_seconds",
    "Age of the oldest waiting run over all lanes, from its acceptance (0 when none waits).",
    (s) => s?.oldestAcceptedMs === undefined ? 0 : Math.max(0, now() - s.oldestAcceptedMs) / 1000,
  );
  fromSnapshot(
    "oncely_queue_lag",
    "Messages not yet delivered to the group, all lanes (the same figure as oncely_queue_waiting).",
    (s) => s?.waiting ?? 0,
  );
  fromSnapshot(
    "oncely_queue_pending",
    "Messages delivered but not yet acknowledged, in the lanes with work.",
    (s) => s === undefined ? 0 : s.depth - s.waiting,
  );
  fromSnapshot(
    "oncely_queue_lanes_with_work",
    "Lanes the backlog's last walk found among the lanes with work.",
    (s) => s?.lanes ?? 0,
  );
  fromSnapshot(
    "oncely_queue_snapshot_age_seconds",
    "Age of the backlog snapshot the queue gauges come from (NaN before the first walk).",
    (s) => s === undefined ? NaN : Math.max(0, now() - s.takenAtMs) / 1000,
  );
  new Gauge({
    name: "oncely_queue_depth",
    help: `Messages in a tenant's lane (waiting or in flight): the ${QUEUE_DEPTH_TENANTS} deepest lanes by ` +
      `tenant, the rest summed as tenant="other".`,
    labelNames: ["tenant"] as const,
    registers: [registry],
    async collect() {
      try {
        const s = await read();
        this.reset();
        if (s === undefined) return;
        // Bounded: one series per tenant would grow with every tenant ever seen.
        const named = s.deepest.slice(0, QUEUE_DEPTH_TENANTS);
        for (const [tenant, depth] of named) this.set({ tenant }, depth);
        this.set({ tenant: "other" }, s.depth - named.reduce((n, [, depth]) => n + depth, 0));
      } catch {
        // A failed read leaves the gauge empty; /metrics must still answer.
      }
    },
  });
}

/**
 * Starts the backlog's walker for this process and installs the queue gauges on `registry`, unless the registry
 * has them already (`dev`: the API's serve them). @returns the walker, for its owner to close; undefined when the
 * registry had them.
 */
export function installQueueGauges(
  registry: Registry,
  { redis, log }: { redis: RedisClient; log: Logger },
  { keys, writer }: { keys: ServiceKeys; writer: string },
): BacklogMonitor | undefined {
  if (registry.getSingleMetric("oncely_queue_waiting")) return undefined;
  const monitor = createBacklogMonitor({ redis, log }, {
    active: keys.registry.active,
    keys: keys.backlog,
    lane: (tenant) => keys.lane(tenant),
    writer,
  });
  queueGauges(registry, monitor);
  return monitor;
}

/** Relay events that feed the relay metrics. */
export function relayEvents(m: RelayMetrics): RelayEvents {
  return {
    sent: (_row, ms) => {
      m.sends.inc({ outcome: "sent" });
      m.sendDuration.observe(ms / 1000);
    },
    retry: () => m.sends.inc({ outcome: "retry" }),
    failed: () => m.sends.inc({ outcome: "failed" }),
  };
}

/** Outbox backlog and the age of the oldest unsent row, read on scrape. */
export function outboxGauges(registry: Registry, sql: Sql): void {
  let cached: { at: number; value: Awaited<ReturnType<typeof outboxBacklog>> } | undefined;
  const read = async () => {
    if (!cached || performance.now() - cached.at > 1_000) {
      cached = { at: performance.now(), value: await outboxBacklog(sql) };
    }
    return cached.value;
  };
  scrapeGauge(
    registry,
    "oncely_outbox_unsent",
    "Outbox rows not yet sent (failed rows excluded).",
    async () => (await read()).unsent,
  );
  scrapeGauge(registry, "oncely_outbox_failed", "Outbox rows that need a person.", async () => (await read()).failed);
  scrapeGauge(
    registry,
    "oncely_outbox_oldest_unsent_seconds",
    "Age of the oldest unsent outbox row.",
    async () => (await read()).oldest_unsent_s,
  );
}

/**
 * Flow-control events that feed the worker metrics: of a named deployment's flows (LLM_DEPLOYMENTS) with its name
 * as the `deployment` label, of the single provider's without one.
 */
export function flowEvents(m: WorkerMetrics, deployment?: string): FlowEvents {
  const by = deployment === undefined ? {} : { deployment };
  if (deployment !== undefined) zeroFlowSeries(m, { deployment });
  return {
    granted: (waitMs, probe) => {
      m.permits.inc({ kind: probe ? "probe" : "permit", ...by });
      m.permitWait.observe(waitMs / 1000);
    },
    limited: (kind) => m.rateLimited.inc({ kind, ...by }),
    tokens: (usage) => {
      m.tokens.inc({ kind: "prompt", ...by }, usage.prompt_tokens);
      m.tokens.inc({ kind: "completion", ...by }, usage.completion_tokens);
    },
    breaker: (_from, to) => m.breakerTransitions.inc({ to, ...by }),
    // Reasons are the classifier's bounded labels (timeout, connection, http_NNN, ...).
    failed: (attribution, reason) => m.modelFailures.inc({ attribution, reason, ...by }),
  };
}

/** A deployment's series of bounded label sets, from 0 (as `workerMetrics` makes the single provider's). */
function zeroFlowSeries(m: WorkerMetrics, by: { deployment: string }): void {
  for (const kind of ["permit", "probe"]) m.permits.inc({ kind, ...by }, 0);
  for (const kind of ["rate_limited", "quota"]) m.rateLimited.inc({ kind, ...by }, 0);
  for (const kind of ["prompt", "completion"]) m.tokens.inc({ kind, ...by }, 0);
  for (const to of ["closed", "open", "half_open"]) m.breakerTransitions.inc({ to, ...by }, 0);
}

const BREAKER_VALUES = { closed: 0, half_open: 1, open: 2 } as const;

/**
 * Each shared breaker's state (0 closed, 1 half-open, 2 open), read from Redis on scrape: one series per flow,
 * labelled `provider` (base URL and model; with LLM_DEPLOYMENTS, the deployment's name first).
 */
export function providerGauges(registry: Registry, flows: readonly { label: string; flow: ProviderFlow }[]): void {
  if (flows.length === 0) return;
  new Gauge({
    name: "oncely_llm_breaker_state",
    help: "The provider's shared circuit breaker: 0 closed, 1 half-open, 2 open.",
    labelNames: ["provider"] as const,
    registers: [registry],
    async collect() {
      await Promise.all(flows.map(async ({ label, flow }) => {
        try {
          const status = await flow.status();
          this.set({ provider: label }, BREAKER_VALUES[status.breaker.state]);
        } catch {
          // A failed read leaves the last value; /metrics must still answer.
        }
      }));
    },
  });
}

/** How many tenants `oncely_result_cache_lookups_total` names in one process; later ones count as `tenant="other"`. */
export const CACHE_METRIC_TENANTS = 1_000;

/** Result-cache lookups that feed its metrics, one series pair per tenant (bounded). */
export function resultCacheEvents(m: ResultCacheMetrics): ResultCacheEvents {
  const named = new Set<string>();
  return {
    lookup(tenant, result) {
      if (!named.has(tenant) && named.size < CACHE_METRIC_TENANTS) {
        named.add(tenant);
        // Both series exist from the tenant's first lookup, so a hit ratio never divides by an absent series.
        for (const r of ["hit", "miss"]) m.lookups.inc({ tenant, result: r }, 0);
      }
      m.lookups.inc({ tenant: named.has(tenant) ? tenant : "other", result });
    },
  };
}
