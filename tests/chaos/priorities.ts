/**
 * Priorities and expiries in every chaos run (issue 41). The task runs the chaos run mixes into its jobs carry a
 * `priority` (high, normal, low, batch, each tenant all four in turn), and two thirds of them an `expires_in`:
 * short ones (1 to 3 s), which expire when a kill, a hang, an outage or a spent budget holds the run past them
 * before its first model attempt goes out, and long ones (10 minutes), which never may. Poison runs set no
 * expiry: they must fail for their output.
 *
 * A run's call has started once its first attempt went out; from then on its expiry no longer applies (its
 * retries, a redelivery's attempts after a kill, its repair call go on, and it ends done or failed). What it
 * checks, once the run is over, from `job_outcomes`, `model_attempts`, the runs' `started` marks in Redis and the
 * requests the fake model(s) received (each names its job: `of job <i>.`):
 *
 * - a run ends `expired` only if it set `expires_in`, never before its `expires_at`, and a long one never;
 * - an expired run made no model call at all: no request for it reached any provider and it has no
 *   `model_attempts` row (one with a call is a failure, whatever the mode);
 * - a run's first model request did not arrive after its `expires_at` (the worker checks the expiry just before
 *   the first attempt goes out, so it may arrive up to {@linkcode SEND_SLACK_MS} after it), unless the run was
 *   marked started before its expiry (its worker was killed between the mark and the send: the only way, and
 *   reported apart); and no `model_attempts` row of a run that had not started by its expiry starts more than
 *   {@linkcode START_SLACK_MS} after it. Later requests of a run that started in time may come at any time;
 * - each expired run's `expires_at` is its `expires_in` after the API took the request: after its first POST
 *   started, and no later than its acceptance (its stream entry's time; later than the request when Redis was
 *   away while the API waited to enqueue it).
 *
 * The report gives, per priority, the runs, how they ended and the median time from acceptance to outcome, the
 * expired runs (all with no model call), and the runs that started before their expiry and called after it.
 */
import type { Sql } from "postgres";
import type { ChatBody, FakeModelServer } from "../support/fake_model_server.ts";

/** The priorities the runs take in turn (`batch` runs as `low`). */
export const PRIORITIES = ["high", "normal", "low", "batch"] as const;
export type Priority = typeof PRIORITIES[number];
/** Short expiries, in seconds: a run held by a kill (CLAIM_IDLE_MS 2 s), a hang (1 s) or an outage reaches them. */
export const SHORT_EXPIRIES_S = [1, 2, 3] as const;
/** A long expiry, in seconds: no chaos run lasts so long, so a run that sets it never expires. */
export const LONG_EXPIRY_S = 600;
/** How long after its run's `expires_at` a model request may arrive: the worker checked before it sent it. */
export const SEND_SLACK_MS = 250;
/** How long after its run's `expires_at` an attempt's `started_at` may be: it is read just after the check. */
export const START_SLACK_MS = 20;
/** How far the clocks of the harness, the API and Redis (one machine) may disagree about the same instant. */
export const CLOCK_SLACK_MS = 1_000;

/** What a run adds to its body: its priority, and its expiry if it has one. */
export interface RunExtras {
  priority: Priority;
  expires_in?: number;
}

/**
 * Run `n`'s priority and expiry (`n` counts the runs, 0, 1, ...; the four tenants take turns, so each turn of four
 * runs has one of each tenant). Drawn from `n` alone, not the run's random source, so a seed repeats the runs it
 * always did. In a turn the four runs have the four priorities, and each tenant's go through the four in turn;
 * the turns go without an expiry, with a short one (1, 1, 2 and 3 s), with a long one, and again.
 */
export function runExtras(n: number, poison: boolean): RunExtras {
  const turn = Math.floor(n / 4);
  const priority = PRIORITIES[(n + turn) % PRIORITIES.length]!;
  if (poison) return { priority };
  switch (turn % 3) {
    case 0:
      return { priority };
    case 1:
      return { priority, expires_in: SHORT_EXPIRIES_S[[0, 0, 1, 2][n % 4]!]! };
    default:
      return { priority, expires_in: LONG_EXPIRY_S };
  }
}

/**
 * In the ticket of two runs of each turn with a short expiry (one of 1 s, the one of 2 s): the model hangs on the
 * first request for it, and the worker gives up after LLM_CALL_TIMEOUT_S (1 s). So the 1 s run's retry goes out
 * after its expiry, which no longer applies to it (its call started): it must end done, never expired; the 2 s
 * one is done by its retry too. Kills, outages and budgets add runs expired with no call at all.
 */
export const HANGS_FIRST_MARK = "SLOW-START: the first answer never comes.";

/** Whether run `n` (as for {@linkcode runExtras}) carries {@linkcode HANGS_FIRST_MARK}. */
export function hangsFirst(n: number, poison: boolean): boolean {
  const { expires_in } = runExtras(n, poison);
  return expires_in !== undefined && expires_in < LONG_EXPIRY_S && n % 2 === 0;
}

/** One run the chaos run submitted (accepted, or taken on without an answer). */
export interface PlannedRun {
  id: string;
  /** Its tenant: the lane its record (and `started` mark) is in. */
  tenant: string;
  /** Its job index: what its model requests name. */
  index: number;
  extras: RunExtras;
  /** A poison run: it must fail. */
  poison: boolean;
  /** Its first model request was left hanging on purpose ({@linkcode HANGS_FIRST_MARK}). */
  slowStart: boolean;
  /** When its first POST started (epoch ms): the API cannot have taken it before. */
  firstPostStartMs: number;
  /** When its last POST ended (epoch ms): it was accepted before then, so it expires at the latest this plus `expires_in`. */
  lastPostEndMs: number;
}

/** What {@linkcode checkPriorities} reads. */
export interface PrioritiesDeps {
  sql: Sql;
  /** Every fake provider the processes called. */
  servers: FakeModelServer[];
  /** The job index a model request names, if it names one. */
  jobOf(body: ChatBody): number | undefined;
  /** When the run was marked started (its record's `started` field, epoch ms), if it was. */
  startedMark(run: PlannedRun): Promise<number | undefined>;
}

/** The report's rows and what failed. */
export interface PrioritiesReport {
  rows: [string, string][];
  problems: string[];
}

/** The median of `values` (NaN for none). */
function median(values: number[]): number {
  if (values.length === 0) return NaN;
  const sorted = [...values].sort((a, b) => a - b);
  const mid = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2;
}

const secondsOf = (ms: number) => (Number.isFinite(ms) ? `${(ms / 1000).toFixed(2)} s` : "-");

/** Checks the runs' outcomes against their priorities and expiries: see the module's comment. */
export async function checkPriorities(deps: PrioritiesDeps, runs: PlannedRun[]): Promise<PrioritiesReport> {
  const rows: [string, string][] = [];
  const problems: string[] = [];
  const ids = runs.map((r) => r.id);
  const outcomes = new Map(
    (await deps.sql<
      { job_id: string; outcome: string; decided: number; accepted: number | null; expires: number | null }[]
    >`
      SELECT job_id::text, outcome,
        (extract(epoch FROM decided_at) * 1000)::float8 AS decided,
        (extract(epoch FROM accepted_at) * 1000)::float8 AS accepted,
        (extract(epoch FROM expires_at) * 1000)::float8 AS expires
      FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[])`).map((o) => [o.job_id, o]),
  );
  const attempts = new Map<string, number[]>();
  for (
    const a of await deps.sql<{ job_id: string; started: number }[]>`
      SELECT job_id::text, (extract(epoch FROM started_at) * 1000)::float8 AS started
      FROM model_attempts WHERE job_id = ANY(${ids}::uuid[])`
  ) attempts.set(a.job_id, [...(attempts.get(a.job_id) ?? []), a.started]);
  // Every request any provider received, by the job it names, as epoch ms.
  const requests = new Map<number, number[]>();
  for (const server of deps.servers) {
    server.bodies.forEach((body, n) => {
      const index = deps.jobOf(body as ChatBody);
      if (index === undefined) return;
      requests.set(index, [...(requests.get(index) ?? []), performance.timeOrigin + server.arrivedAt[n]!]);
    });
  }

  let lateRequests = 0, lateAttempts = 0, slackRequests = 0, expiredNoCall = 0, expiredWithCalls = 0;
  let startedThenLater = 0, markedThenKilled = 0;
  let latestRequestMs = -Infinity, latestAttemptMs = -Infinity;
  const wrong: string[] = [];
  for (const run of runs) {
    const o = outcomes.get(run.id);
    const expiresIn = run.extras.expires_in;
    if (!o) continue; // not decided: the chaos run's own checks count it lost
    const sent = [...(requests.get(run.index) ?? [])].sort((a, b) => a - b);
    const recorded = attempts.get(run.id) ?? [];
    if (o.outcome === "expired") {
      if (expiresIn === undefined) wrong.push(`${run.id} expired without an expires_in`);
      else if (expiresIn === LONG_EXPIRY_S) wrong.push(`${run.id} expired with expires_in ${LONG_EXPIRY_S}`);
      if (o.expires === null) wrong.push(`${run.id} expired with no expires_at`);
      else {
        if (o.decided < o.expires) wrong.push(`${run.id} was decided expired ${o.expires - o.decided} ms early`);
        // expires_at is expires_in after the API took the request (its clock, before the intake script ran), so
        // its start lies between the run's first POST and its acceptance (the stream entry's time, later when
        // Redis was away while the API waited to enqueue it).
        if (expiresIn !== undefined) {
          const start = o.expires - expiresIn * 1000;
          const latest = o.accepted ?? run.lastPostEndMs;
          if (start < run.firstPostStartMs - CLOCK_SLACK_MS || start > latest + CLOCK_SLACK_MS) {
            wrong.push(
              `${run.id}'s expiry started ${start - run.firstPostStartMs} ms after its first POST and ${
                start - latest
              } ms after its acceptance (expires_in ${expiresIn})`,
            );
          }
        }
      }
      // An expired run never called the model: not before its expiry (its call would have started, and the
      // expiry no longer applied), not after.
      if (sent.length === 0 && recorded.length === 0) expiredNoCall++;
      else {
        expiredWithCalls++;
        wrong.push(
          `${run.id} expired after a model call (${sent.length} request(s) at a provider, ${recorded.length} attempt row(s))`,
        );
      }
    }
    if (expiresIn === undefined) continue;
    // The expiry: exact for an expired run; else its acceptance plus expires_in, or at the latest its last POST's end.
    const expiresAt = o.expires ??
      (o.accepted !== null ? o.accepted + expiresIn * 1000 : run.lastPostEndMs + expiresIn * 1000);
    const first = sent[0];
    // Started in time: its first request went out before its expiry. Its later ones (retries, a redelivery's after a
    // kill, the repair call) may come at any time.
    const startedInTime = first !== undefined && first <= expiresAt + SEND_SLACK_MS;
    let excused = false;
    if (first !== undefined) {
      latestRequestMs = Math.max(latestRequestMs, first - expiresAt);
      if (first > expiresAt + SEND_SLACK_MS) {
        // Marked started before its expiry, then its worker killed before the send: a later delivery sent it.
        const mark = await deps.startedMark(run).catch(() => undefined);
        excused = mark !== undefined && mark < expiresAt;
        if (excused) markedThenKilled++;
        else lateRequests++;
      } else if (first > expiresAt) slackRequests++;
      if (startedInTime && sent.some((at) => at > expiresAt + SEND_SLACK_MS)) startedThenLater++;
    }
    if (!startedInTime && !excused) {
      for (const at of recorded) {
        latestAttemptMs = Math.max(latestAttemptMs, at - expiresAt);
        if (at > expiresAt + START_SLACK_MS) lateAttempts++;
      }
    }
  }

  for (const priority of PRIORITIES) {
    const mine = runs.filter((r) => r.extras.priority === priority);
    const ended = (outcome: string) => mine.filter((r) => outcomes.get(r.id)?.outcome === outcome);
    const done = ended("done");
    // The runs whose first request hung on purpose wait a second for it: they would say nothing of the queue.
    const latency = done.filter((r) => !r.slowStart).map((r) => outcomes.get(r.id)!).filter((o) => o.accepted !== null)
      .map((o) => o.decided - o.accepted!);
    rows.push([
      `priority ${priority}: runs (short expiry, long) / done / failed (poison) / expired / median acceptance to done (no scripted hang)`,
      `${mine.length} (${mine.filter((r) => (r.extras.expires_in ?? LONG_EXPIRY_S) < LONG_EXPIRY_S).length}, ${
        mine.filter((r) => r.extras.expires_in === LONG_EXPIRY_S).length
      }) / ${done.length} / ${ended("failed").length} / ${ended("expired").length} / ${secondsOf(median(latency))}`,
    ]);
  }
  const short = runs.filter((r) => r.extras.expires_in !== undefined && r.extras.expires_in < LONG_EXPIRY_S);
  const shortExpired = short.filter((r) => outcomes.get(r.id)?.outcome === "expired").length;
  rows.push(
    [
      `runs with a short expiry (${SHORT_EXPIRIES_S.join(", ")} s): expired / done`,
      `${shortExpired} / ${short.filter((r) => outcomes.get(r.id)?.outcome === "done").length}`,
    ],
    [
      "expired runs with no model call / with a model call (must be 0)",
      `${expiredNoCall} / ${expiredWithCalls}`,
    ],
    [
      `expiring runs' first model request after expires_at: beyond ${SEND_SLACK_MS} ms / within it (latest, relative)`,
      `${lateRequests} / ${slackRequests} (${
        Number.isFinite(latestRequestMs) ? `${Math.round(latestRequestMs)} ms` : "-"
      })`,
    ],
    [
      "runs marked started before their expiry whose first request came later (a kill between mark and send)",
      String(markedThenKilled),
    ],
    [
      "runs started before their expiry that called again after it (retries, redeliveries, repairs)",
      String(startedThenLater),
    ],
    [
      `attempts (model_attempts) of runs not started in time, started after expires_at + ${START_SLACK_MS} ms (latest)`,
      `${lateAttempts} (${Number.isFinite(latestAttemptMs) ? `${Math.round(latestAttemptMs)} ms` : "-"})`,
    ],
  );
  if (expiredWithCalls > 0) problems.push(`${expiredWithCalls} expired run(s) had a model call`);
  if (lateRequests > 0) problems.push(`${lateRequests} run(s)' first model request arrived after their expires_at`);
  if (lateAttempts > 0) problems.push(`${lateAttempts} attempt(s) started after their run's expires_at`);
  problems.push(...wrong.slice(0, 10));
  if (wrong.length > 10) problems.push(`... and ${wrong.length - 10} more runs decided wrongly for their expiry`);
  return { rows, problems };
}
