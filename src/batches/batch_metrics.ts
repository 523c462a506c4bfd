/**
 * The metrics of batch runs (issue 43), on a worker process with a batch deployment: the batches in flight by
 * state and deployment, their runs whose lines are not settled, and the oldest one's age, read from Postgres; and
 * the lines this process settled, by outcome.
 *
 * The gauges are figures of the whole database, not of this process: every worker with a batch deployment
 * exports the same ones, so a query takes max() over them. They come from one aggregate query
 * (`batchesInFlight`), made at most once every `refreshMs` whatever the number of scrapes and gauges.
 */
import { Counter, Gauge, type Registry } from "prom-client";
import type { Queryable } from "../db/queryable.ts";
import { batchesInFlight, type BatchLineOutcome, type BatchState, type InFlightBatches } from "./batch_store.ts";

/** The states of a batch in flight (every state but `committed`), each a series of `oncely_batches_in_flight`. */
export const IN_FLIGHT_STATES: readonly Exclude<BatchState, "committed">[] = [
  "open",
  "closed",
  "uploading",
  "uploaded",
  "creating",
  "submitted",
  "ended",
];

/** How a line is settled, each a series of `oncely_batch_lines_settled_total`. */
export const LINE_OUTCOMES: readonly BatchLineOutcome[] = ["committed", "failed", "online", "left_out"];

/** Defaults of {@linkcode batchMetrics}. */
export const BATCH_METRICS_DEFAULTS = {
  /** How long one read of the batches in flight serves the scrapes that follow it. */
  refreshMs: 2_000,
} as const;

/** What the submitter and the poller report to the metrics. */
export interface BatchEvents {
  /** `lines` lines of a batch of `deployment` were settled as `outcome` (by this process, once each). */
  settled(outcome: BatchLineOutcome, lines: number, deployment: string): void;
}

const registered = new WeakMap<Registry, BatchEvents>();

/**
 * Registers the batch metrics on `registry` (once per registry: `dev` runs its components on one). Every
 * configured batch deployment has its series from the start (0), so an alert can tell 0 from absent; a
 * deployment no longer configured shows while it has batches in flight.
 * @returns the events that count settled lines.
 */
export function batchMetrics(
  registry: Registry,
  { sql }: { sql: Queryable },
  { deployments, refreshMs = BATCH_METRICS_DEFAULTS.refreshMs, now = () => performance.now() }: {
    deployments: readonly string[];
    refreshMs?: number;
    now?: () => number;
  },
): BatchEvents {
  const known = registered.get(registry);
  if (known) return known;
  const read = sharedRead(() => batchesInFlight(sql), refreshMs, now);
  const registers = [registry];
  /** A gauge set from the rows on each collect, every configured deployment's series at 0 first. */
  const fromRows = (
    name: string,
    help: string,
    labelNames: readonly ("state" | "deployment")[],
    fill: (gauge: Gauge<"state" | "deployment">, rows: InFlightBatches[]) => void,
  ) =>
    new Gauge({
      name,
      help,
      labelNames,
      registers,
      async collect() {
        try {
          const rows = await read();
          this.reset();
          fill(this, rows);
        } catch {
          // A failed read leaves the last values; /metrics must still answer.
        }
      },
    });
  fromRows(
    "oncely_batches_in_flight",
    "Provider batches not yet committed, by state and deployment (the whole database's, as of the last read).",
    ["state", "deployment"],
    (gauge, rows) => {
      for (const deployment of deployments) for (const state of IN_FLIGHT_STATES) gauge.set({ state, deployment }, 0);
      for (const r of rows) gauge.set({ state: r.state, deployment: r.deployment }, r.batches);
    },
  );
  fromRows(
    "oncely_batch_runs_waiting",
    "Runs recorded in a batch not yet committed whose lines are not settled yet, by deployment.",
    ["deployment"],
    (gauge, rows) => {
      for (const [deployment, runs] of byDeployment(deployments, rows, (n, r) => n + r.runs_waiting)) {
        gauge.set({ deployment }, runs);
      }
    },
  );
  fromRows(
    "oncely_batch_oldest_in_flight_seconds",
    "Age of the oldest batch not yet committed, from its opening, by deployment (0 when none).",
    ["deployment"],
    (gauge, rows) => {
      for (const [deployment, age] of byDeployment(deployments, rows, (s, r) => Math.max(s, r.oldest_s))) {
        gauge.set({ deployment }, age);
      }
    },
  );
  const settled = new Counter({
    name: "oncely_batch_lines_settled_total",
    help: "Batch lines this process settled, by deployment and outcome: committed (or found decided), failed, " +
      "online (sent back to the online path) or left_out (decided before the upload).",
    labelNames: ["deployment", "outcome"] as const,
    registers,
  });
  for (const deployment of deployments) {
    for (const outcome of LINE_OUTCOMES) settled.inc({ deployment, outcome }, 0);
  }
  const events: BatchEvents = {
    settled: (outcome, lines, deployment) => settled.inc({ deployment, outcome }, lines),
  };
  registered.set(registry, events);
  return events;
}

/** The rows folded by deployment, from 0 for each configured one. */
function byDeployment(
  deployments: readonly string[],
  rows: InFlightBatches[],
  fold: (value: number, row: InFlightBatches) => number,
): Map<string, number> {
  const out = new Map(deployments.map((d) => [d, 0]));
  for (const r of rows) out.set(r.deployment, fold(out.get(r.deployment) ?? 0, r));
  return out;
}

/**
 * `read`, shared: the gauges of one scrape start their collects together and share the read in flight, and a read
 * that succeeded serves every collect for `maxAgeMs` after it started.
 */
function sharedRead<T>(read: () => Promise<T>, maxAgeMs: number, now: () => number): () => Promise<T> {
  let last: { at: number; value: Promise<T>; done: boolean } | undefined;
  return () => {
    if (!last || (last.done && now() - last.at >= maxAgeMs)) {
      const entry = { at: now(), value: read(), done: false };
      last = entry;
      entry.value.then(() => void (entry.done = true), () => {
        // A failed read is not kept: the next collect tries again.
        if (last === entry) last = undefined;
      });
    }
    return last.value;
  };
}
