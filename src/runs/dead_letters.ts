/**
 * Replaying the summary pipeline's dead letters, as `deno task dlq replay`
 * and the console's Replay buttons do: the replay claims the dead letter,
 * Postgres decides next (a job that already had its effects, or was
 * cancelled, never runs again), then the dead letter goes back to its lane
 * with its original job id.
 */
import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import {
  claimReplay,
  DeadLetterExpired,
  DeadLetterTruncated,
  releaseReplay,
  REPLAY_BOUNDS,
  replayAs,
  ReplayNotReplicated,
} from "../queue/dead_letter.ts";
import { NotReplicated, type ReplicaAck } from "../redis/replica_ack.ts";
import { deadLetterPages, type LaneDeadLetter } from "../queue/inspector.ts";
import { announceLane } from "../queue/lanes.ts";
import { acceptedMsOf } from "../queue/message.ts";
import { allLanes } from "./all_lanes.ts";
import { failJob, type RunOf, SUMMARY_RUN } from "../jobs/job_store.ts";
import { runOfPayload } from "./run_payload.ts";
import { reopenFailedJob } from "./commit.ts";
import { markQueuedOnReplay } from "./job_status.ts";
import type { LaneKeys, ServiceKeys } from "./keys.ts";
import { JOB_ID } from "./shapes.ts";

/** Which dead letters to replay: all of them, or the one with stream id `id` (in `tenant`'s lane when given). */
export type ReplayTarget = { all: true } | { all?: false; id: string; tenant?: string };

/** What happened to one chosen dead letter, in the order they were tried. */
export type ReplayStep =
  /** `unreplicated`: replayed on the primary, but too few replicas acknowledged it in time (why, in words). */
  | { replayed: true; id: string; newId: string; jobId?: string; tenant?: string; unreplicated?: string }
  | { replayed: false; id: string; message: string };

/** The answer to a replay. */
export type ReplayReport =
  /** No dead letter matched. */
  | { kind: "none" }
  /** The id names dead letters in more than one lane (each lane numbers its own): nothing done. */
  | { kind: "ambiguous"; lanes: string[] }
  | {
    kind: "done";
    steps: ReplayStep[];
    replayed: number;
    refused: number;
    /** Replayed steps that too few replicas acknowledged in time (REDIS_MIN_REPLICAS_ACK). */
    unreplicated: number;
    /** Chosen dead letters not tried: the replay stopped at the first one the replicas did not acknowledge. */
    untried: number;
    /** Replayed ones whose lane announce failed: the workers find them at the lane sweep (within 30 s). */
    unannounced: number;
  };

/**
 * Replays the dead letters `target` names. Replaying twice is harmless, one
 * after the other or at once: each dead letter is replayed once, and its job
 * is left queued and undecided (a replay that finds another one holding the
 * dead letter is refused by name). Each Redis step is safe to resend. It
 * refuses, by name, a dead letter whose job is already done or cancelled,
 * or that is truncated or too old. With `ack` (REDIS_MIN_REPLICAS_ACK) each
 * replay waits for the replicas, and the first one they do not acknowledge
 * in time ends the run (the next ones would only wait as long).
 */
export async function replayDeadLetters(
  { redis, sql, ack }: { redis: RedisClient; sql: Sql; ack?: ReplicaAck },
  keys: ServiceKeys,
  target: ReplayTarget,
  /** Told of each step as it happens, so a replay that fails midway has said what it did before. */
  onStep?: (step: ReplayStep) => void,
): Promise<ReplayReport> {
  const chosen: LaneDeadLetter<LaneKeys>[] = [];
  for await (const page of deadLetterPages(redis, await allLanes(redis, keys))) {
    chosen.push(
      ...(target.all
        ? page
        : page.filter((d) => d.id === target.id && (target.tenant === undefined || d.lane.tenant === target.tenant))),
    );
  }
  if (chosen.length === 0) return { kind: "none" };
  if (!target.all && chosen.length > 1) return { kind: "ambiguous", lanes: chosen.map((d) => d.lane.tenant) };
  const steps: ReplayStep[] = [];
  const record = (step: ReplayStep) => {
    steps.push(step);
    onStep?.(step);
  };
  // The replay is done once its script ran: an announce that fails (a node failing over) only delays the workers
  // until the lane sweep finds the lane, so it must not turn a replay that happened into an error.
  let unannounced = 0;
  const wake = async (tenant: string) => {
    await announceLane(redis, keys.registry, tenant).catch(() => unannounced++);
  };
  let untried = 0;
  for (const [i, d] of chosen.entries()) {
    const jobId = d.fields.job_id;
    const lane = d.lane.keys;
    const named = `(job ${jobId ?? "?"}, tenant ${d.fields.tenant ?? "?"})`;
    const decidable = jobId !== undefined && JOB_ID.test(jobId);
    // Puts back the 'failed' outcome the reopen below took back, for a dead letter that stays dead (or is gone
    // without a replay): the job is failed again, as its dead letter says.
    const decideFailedAgain = async () => {
      if (!decidable || !d.fields.tenant) return;
      await failJob(sql, jobId, d.fields.tenant, d.reason, {
        ...runOf(d.fields.payload),
        acceptedMs: acceptedMsOf({ id: d.original_id, fields: d.fields }),
      });
    };
    const claim = { deadId: d.id, token: crypto.randomUUID() };
    let reopened = false;
    let done: Awaited<ReturnType<typeof replayAs>>;
    try {
      if (d.truncated.length > 0) throw new DeadLetterTruncated(d.id, d.truncated);
      if (d.expired) throw new DeadLetterExpired(d.id);
      // Claim first: of two replays of one dead letter, only the one holding it may take its job's failure back
      // in Postgres. Without the claim the other, finding the dead letter gone, would put the failure back while
      // the job waits in its lane, and the job would be dead-lettered again unrun.
      const missed = await claimReplay(redis, lane, claim);
      if (missed?.kind === "held") {
        record({ replayed: false, id: d.id, message: heldMessage(d.id, named) });
        continue;
      }
      // Replayed by another replay meanwhile, or gone: nothing to do, and nothing was changed.
      if (missed) continue;
      // Postgres next: a job that already had its effects (or was cancelled) never runs again, and a failed one
      // is made undecided before it is queued again, so no worker finds it failed in its lane. A crash between
      // the two leaves it undecided and still dead-lettered: replaying again (once the claim lapses) finishes it.
      const already = decidable ? await reopenFailedJob(sql, jobId) : null;
      if (already) {
        await releaseReplay(redis, lane, claim);
        record({
          replayed: false,
          id: d.id,
          message: `Dead letter ${d.id} ${named} is not replayed: its job is already ${already}. Nothing done.`,
        });
        continue;
      }
      reopened = true;
      // Asked again with the same token when Redis answers with an error (a reply lost with its connection): the
      // script answers a replay it already made, and enqueues nothing twice.
      for (let attempt = 1;; attempt++) {
        try {
          done = await replayAs(redis, lane, claim, decidable ? markQueuedOnReplay(lane, jobId) : undefined, { ack });
          break;
        } catch (error) {
          const typed = error instanceof NotReplicated || error instanceof DeadLetterTruncated ||
            error instanceof DeadLetterExpired;
          if (typed || attempt >= 3) throw error;
          await new Promise((resolve) => setTimeout(resolve, 200 * attempt));
        }
      }
    } catch (error) {
      if (error instanceof ReplayNotReplicated) {
        // In the lane's stream on the primary all the same: wake the workers, and say what is not yet safe.
        await wake(d.lane.tenant);
        record({
          replayed: true,
          id: d.id,
          newId: error.newId,
          jobId,
          tenant: d.fields.tenant,
          unreplicated: error.message,
        });
        untried = chosen.length - i - 1;
        break;
      }
      if (error instanceof NotReplicated) {
        // No connection came free to wait on: the replay did not run and the dead letter is still there. Put
        // Postgres's decision back (it was taken back above), and let another replay have the dead letter.
        await decideFailedAgain();
        await releaseReplay(redis, lane, claim);
        record({
          replayed: false,
          id: d.id,
          message: `Dead letter ${d.id} ${named} is not replayed: ${error.message}.`,
        });
        untried = chosen.length - i - 1;
        break;
      }
      if (!(error instanceof DeadLetterTruncated) && !(error instanceof DeadLetterExpired)) throw error;
      // Refused by the script itself (the listing said whole and young): the dead letter stays, so does the failure.
      if (reopened) {
        await decideFailedAgain();
        await releaseReplay(redis, lane, claim);
      }
      record({ replayed: false, id: d.id, message: `${error.message} ${named}` });
      continue;
    }
    // Gone while this replay held it (trimmed): it never runs again, so its job is failed again.
    if (done.kind === "gone") await decideFailedAgain();
    // Another replay took it over after this one's claim lapsed: that replay decides the job; leave Postgres to it.
    if (done.kind !== "replayed") continue;
    // Back in its lane's stream: tell the workers, as an enqueue does.
    await wake(d.lane.tenant);
    record({ replayed: true, id: d.id, newId: done.newId, jobId, tenant: d.fields.tenant });
  }
  const replayed = steps.filter((s) => s.replayed).length;
  const unreplicated = steps.filter((s) => s.replayed && s.unreplicated).length;
  return { kind: "done", steps, replayed, refused: steps.length - replayed, unreplicated, untried, unannounced };
}

/** The one line that sums up a replay, as `dlq replay` ends with and the console shows. */
export function replaySummary(report: ReplayReport, target: ReplayTarget): string {
  if (report.kind === "none") {
    return target.all ? "Nothing to replay." : `No dead letter ${target.id} (already replayed?). Nothing done.`;
  }
  if (report.kind === "ambiguous") {
    return `Dead letter ${target.all ? "" : target.id} exists in the lanes of ${
      report.lanes.join(", ")
    }; add --tenant T to say which. Nothing done.`;
  }
  return `${report.replayed} dead letter(s) replayed.` +
    (report.refused ? ` ${report.refused} could not be (see above).` : "") +
    (report.unreplicated ? ` ${report.unreplicated} not yet acknowledged by enough Redis replicas (see above).` : "") +
    (report.untried
      ? ` Stopped there: ${report.untried} not tried; replay again once the replicas have caught up.`
      : "") +
    (report.unannounced
      ? ` ${report.unannounced} could not be announced to the workers (Redis refused); they find them within 30 s.`
      : "");
}

/** Why a dead letter another replay holds is refused, with when to try again. */
function heldMessage(deadId: string, named: string): string {
  return `Dead letter ${deadId} ${named} is being replayed by another replay (dlq replay or the console), or by one ` +
    `that stopped less than ${REPLAY_BOUNDS.claimMs / 1000} s ago. Nothing done; if it is still listed after that, ` +
    `replay it again.`;
}

/** The task and version a dead letter's payload names (summarize v1 for a summary job or an unreadable one). */
function runOf(payload: string | undefined): RunOf {
  try {
    const { task, version } = runOfPayload(payload ?? "");
    return { task, version };
  } catch {
    return SUMMARY_RUN;
  }
}
