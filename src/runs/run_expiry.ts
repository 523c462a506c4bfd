/**
 * A run's expiry (`expires_in`, issue 41). A run whose payload carries `expires_at` and whose model call has not
 * started by then ends `expired`, with no model call: a run taken after it, or whose wait for a permit reaches
 * it, is decided `expired` in Postgres (`job_outcomes`, the primary key every outcome races on), with its
 * `run.expired` notification in the same transaction. Its call has started once its first attempt goes out;
 * from then on the expiry no longer applies: the attempt finishes, and its retries, a later delivery's attempts
 * and the repair call go on as for any run, which ends done or failed, never expired.
 *
 * Crash-safe: just before its first attempt goes out, a run with an expiry marks its job's record (`started`,
 * {@linkcode goingOut}), and every delivery of such a run reads the mark first ({@linkcode startedEarlier}).
 * So a run reclaimed after its worker died mid-call is not expired: it is called again. The mark comes before
 * the send, never after: a worker killed between the two leaves a run marked that sent nothing, which a later
 * delivery calls (after its expiry, if that has passed), but never a run expired after a call.
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
 * Whether the delivery's run has reached its expiry before its model call started (never, for a run without one
 * or one whose attempt went out: {@linkcode Delivery.started}).
 */
export function hasExpired({ run, started }: Delivery, clock: Clock = systemClock): boolean {
  return run.expiresAt !== undefined && !started && clock.epochNow() >= run.expiresAt;
}

/**
 * Reads whether an earlier delivery of the run sent a model attempt (its `started` mark), into
 * {@linkcode Delivery.started}: then its expiry no longer applies. Only a run with an expiry asks.
 * @throws Redis's error, to leave the message pending (whether the run may expire is not known without it).
 */
export async function startedEarlier(job: Job, delivery: Delivery): Promise<void> {
  if (delivery.run.expiresAt === undefined || !job.starts) return;
  if (await job.starts.started(delivery.job_id, delivery.tenant)) delivery.started = true;
}

/**
 * Called once an attempt holds its permit and reservation, just before it is sent: the last check of the run's
 * expiry. For a run with an expiry whose call has not started, it marks the run started (in its record, awaited)
 * and looks at the expiry again after the mark's round trip, so no first attempt goes out past the expiry; from
 * then on, {@linkcode Delivery.started}: no later attempt of the run is held to it.
 * @throws {RunExpired} when the run reached its expiry before the attempt could go out (it has not gone out).
 * @throws Redis's error when the mark could not be written (the attempt must not go out unmarked).
 */
export async function goingOut(job: Job, delivery: Delivery, clock: Clock = systemClock): Promise<void> {
  const at = delivery.run.expiresAt;
  if (at === undefined || delivery.started) return;
  throwIfExpired(delivery, clock);
  await job.starts?.mark(delivery.job_id, delivery.tenant, clock.epochNow());
  // A mark written at the expiry's edge: the attempt still does not go out. A delivery that dies before it
  // decides the run leaves it marked; the next one calls it (see the module's comment).
  if (clock.epochNow() >= at) throw new RunExpired(delivery.job_id, at);
  delivery.started = true;
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
 * @throws Postgres's error, to leave the message pending (a later delivery decides).
 */
export async function expire(job: Job, delivery: Delivery, stage: string): Promise<Committed> {
  const { job_id, tenant, run, message, log } = delivery;
  const expiresAtMs = run.expiresAt!;
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
