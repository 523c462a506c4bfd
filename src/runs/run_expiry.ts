/**
 * A run's expiry (`expires_in`, issue 41). A run whose payload carries `expires_at` and whose model call has not
 * started by then ends `expired`, with no model call: a run taken after it, or whose wait for a permit reaches
 * it, is decided `expired` in Postgres (`job_outcomes`, the primary key every outcome races on), with its
 * `run.expired` notification in the same transaction. Its call has started once its first attempt goes out;
 * from then on the expiry no longer applies: the attempt finishes, and its retries, a later delivery's attempts
 * and the repair call go on as for any run, which ends done or failed, never expired.
 *
 * Decided once, for every delivery: just before a run with an expiry sends its first attempt, the worker asks its
 * job record to let it start ({@linkcode goingOut}), and before it decides the run expired, it asks the record
 * to say so ({@linkcode expire}); the first answer stands (`decideStart`: granted a start only before the expiry
 * by Redis's clock), and every delivery reads it first ({@linkcode startedEarlier}). So a run reclaimed after its
 * worker died mid-call is called again, never expired; a delivery that stalled past its claim while another took
 * the run over cannot expire it after the other let its attempt go out, nor send after the other decided it
 * expired. The decision comes before the send, never after: a worker killed between the two leaves a run let
 * start that sent nothing, which a later delivery calls (after its expiry, if that has passed), but never a run
 * expired after a call.
 */
import { linkedSignal } from "../async/linked_signal.ts";
import type { Acquired } from "../llm/models.ts";
import { acceptedMsOf } from "../queue/message.ts";
import { type Clock, systemClock } from "../retry/clock.ts";
import { GateRefused } from "../retry/errors.ts";
import { currentTraceparent } from "../tracing.ts";
import { type Committed, expireRun } from "./commit.ts";
import { endedBy } from "./run_decided.ts";
import type { Delivery, Job } from "./run_deps.ts";

/**
 * The run reached its expiry before its first attempt went out. A `GateRefused`, so the retry policy hands it
 * back as it is, and the run job decides the run expired ({@linkcode expire}).
 */
export class RunExpired extends GateRefused {
  constructor(jobId: string, readonly expiresAtMs: number) {
    super(`run ${jobId} expired at ${new Date(expiresAtMs).toISOString()} before its model call started`);
    this.name = "RunExpired";
  }
}

/**
 * A delivery about to decide its run expired found it let start by another delivery (a concurrent one, after
 * this one stalled past its claim): the run is not expired, and the message is left pending.
 */
export class RunStartedElsewhere extends Error {
  constructor(readonly jobId: string) {
    super(`run ${jobId} started its model call in another delivery: not expired`);
    this.name = "RunStartedElsewhere";
  }
}

/**
 * Whether the delivery's run has reached its expiry before its model call started (never, for a run without one
 * or one let start: {@linkcode Delivery.started}), or was decided expired by another delivery.
 */
export function hasExpired({ run, started, decidedExpired }: Delivery, clock: Clock = systemClock): boolean {
  if (run.expiresAt === undefined || started) return false;
  return decidedExpired === true || clock.epochNow() >= run.expiresAt;
}

/**
 * Reads the run's start decision, made by an earlier or concurrent delivery, into the delivery: let start
 * ({@linkcode Delivery.started}: its expiry no longer applies) or expired ({@linkcode Delivery.decidedExpired}).
 * Only a run with an expiry asks.
 * @throws Redis's error, to leave the message pending (whether the run may expire is not known without it).
 */
export async function startedEarlier(job: Job, delivery: Delivery): Promise<void> {
  if (delivery.run.expiresAt === undefined || !job.starts) return;
  const decided = await job.starts.read(delivery.job_id, delivery.tenant);
  if (decided === "expired") delivery.decidedExpired = true;
  else if (decided !== undefined) delivery.started = true;
}

/**
 * Called once an attempt holds its permit and reservation, just before it is sent: for a run with an expiry, the
 * first attempt of each delivery asks its record to let it start (granted only before the expiry, by Redis's
 * clock, unless an earlier delivery was let start), and waits for the answer to be written (and replicated, under
 * REDIS_MIN_REPLICAS_ACK, also when an earlier delivery wrote it). Then {@linkcode Delivery.started}: no later
 * attempt of the run is held to its expiry.
 * @throws {RunExpired} when the run was decided expired (it has not gone out).
 * @throws Redis's error when no decision could be written (the attempt must not go out undecided).
 */
export async function goingOut(job: Job, delivery: Delivery, clock: Clock = systemClock): Promise<void> {
  const at = delivery.run.expiresAt;
  if (at === undefined || delivery.decided) return;
  throwIfExpired(delivery, clock);
  if (!job.starts) {
    delivery.started = true;
    return;
  }
  const decided = await job.starts.decide(delivery.job_id, delivery.tenant, "start", at);
  if (decided === "expired") {
    delivery.decidedExpired = true;
    throw new RunExpired(delivery.job_id, at);
  }
  delivery.decided = delivery.started = true;
}

/**
 * Throws when the delivery's run has reached its expiry: the check made just before an attempt would go out.
 * @throws {RunExpired} when it has.
 */
export function throwIfExpired(delivery: Delivery, clock: Clock = systemClock): void {
  if (hasExpired(delivery, clock)) throw new RunExpired(delivery.job_id, delivery.run.expiresAt!);
}

/** One wait for a permit, bounded by the run's expiry (see {@linkcode untilExpiry}). */
export interface ExpiryBound {
  /** The wait's signal: aborts when the wait's own signal does, or with {@linkcode RunExpired} at the expiry. */
  signal: AbortSignal;
  /** Aborts at the expiry alone (never, for a run without one). */
  expired?: AbortSignal;
  /** Stops the timer and unlinks: call it once the wait is over. */
  done(): void;
}

/**
 * `signal`, linked for one wait (a permit's) with the run's expiry: it aborts with {@linkcode RunExpired} at the
 * run's `expires_at`, so the wait ends there. A run without an expiry, or whose call has started, gets `signal`
 * itself.
 */
export function untilExpiry(delivery: Delivery, signal: AbortSignal, clock: Clock = systemClock): ExpiryBound {
  const at = delivery.started ? undefined : delivery.run.expiresAt;
  if (at === undefined) return { signal, done: () => {} };
  const expiry = new AbortController();
  const fire = () => expiry.abort(new RunExpired(delivery.job_id, at));
  const left = at - clock.epochNow();
  const timer = left > 0 ? clock.timer(left) : undefined;
  if (timer) timer.signal.addEventListener("abort", fire, { once: true });
  else fire();
  const linked = linkedSignal(signal, expiry.signal);
  return {
    signal: linked.signal,
    expired: expiry.signal,
    done() {
      timer?.cancel();
      timer?.signal.removeEventListener("abort", fire);
      linked.unlink();
    },
  };
}

/**
 * The permit `acquiring` grants, unless the run's expiry comes first: then {@linkcode RunExpired} at once, and a
 * permit granted after that goes back unsent (a deployment that does not hear its signal still cannot keep the run
 * waiting past its expiry, nor keep the permit).
 * @throws {RunExpired} at the expiry; what `acquiring` throws.
 */
export function beforeExpiry(acquiring: Promise<Acquired>, { expired }: ExpiryBound): Promise<Acquired> {
  if (!expired) return acquiring;
  const giveBack = () =>
    acquiring.then((late) => late.permit?.settle({ aborted: true, notSent: true }), () => {}).catch(() => {});
  if (expired.aborted) {
    giveBack();
    return Promise.reject(expired.reason);
  }
  return new Promise<Acquired>((resolve, reject) => {
    const onExpired = () => {
      giveBack();
      reject(expired.reason);
    };
    expired.addEventListener("abort", onExpired, { once: true });
    acquiring.then(resolve, reject).finally(() => expired.removeEventListener("abort", onExpired));
  });
}

/**
 * Decides the delivery's run expired, with its notification, unless it was decided first (done, cancelled,
 * failed: that decision stands and the delivery ends as it says). Only for a run none of whose attempts went
 * out: it made no model call and pays nothing (a budget reservation is made only once a call may go out, and a
 * permit it held has gone back unsent).
 * @throws {JobFailedElsewhere} when another delivery decided it failed first.
 * @throws {RunStartedElsewhere} when another delivery let the run start first (the message is left pending).
 * @throws Redis's or Postgres's error, to leave the message pending (a later delivery decides).
 */
export async function expire(job: Job, delivery: Delivery, stage: string): Promise<Committed> {
  const { job_id, tenant, run, message, log } = delivery;
  const expiresAtMs = run.expiresAt!;
  // The record decides first: a delivery that took the run over (this one stalled past its claim) may have let
  // its attempt go out meanwhile. Then the run is not expired: this delivery leaves the message pending, and the
  // other commits it (or a later delivery, reading the decision, calls it).
  if (job.starts && await job.starts.decide(job_id, tenant, "expire", expiresAtMs) !== "expired") {
    delivery.started = true;
    throw new RunStartedElsewhere(job_id);
  }
  const outcome = await expireRun(job.sql, {
    jobId: job_id,
    tenant,
    task: run.task,
    version: run.version,
    notify: run.notify,
    acceptedMs: acceptedMsOf(message),
    traceparent: currentTraceparent(),
  }, expiresAtMs);
  if (outcome !== "expired") return endedBy(delivery, outcome, stage);
  log.info("job_expired", {
    stage,
    deliveries: message.deliveries,
    expires_at: new Date(expiresAtMs).toISOString(),
  });
  return "expired";
}
