/**
 * The Batch API's online path: a run its batch did not finish (an expired or cancelled batch under
 * `BATCH_ON_EXPIRY=online`, a transient error line) goes back on its lane's low stream, as a `low` run, so the
 * worker runs it online and never records it into a batch again. So does a structured run's answer, for the
 * worker to check against its output schema (it carries the answer: no first call is made).
 *
 * The send happens before the poller records the run settled in Postgres (`batch_runs.settled = 'online'`), so a
 * process killed between the two sends it again; so does a client that resends a script whose reply was lost.
 * Either way the run is queued once: the script writes a marker keyed by the run id in the same step as the
 * entry, and a second run of it finds the marker and adds nothing.
 *
 * Under REDIS_MIN_REPLICAS_ACK the script is followed by a `WAIT` in the same round trip, and a send short of its
 * replicas throws, so the line is not recorded `online` until its entry is on them: a failover just after could
 * otherwise lose an entry Postgres says was sent. The send is then repeated (the poller's next pass), and the
 * repeat's own write makes its `WAIT` cover the entry.
 */
import type { RedisClient } from "../clients.ts";
import { notReplicated, type ReplicaAck } from "../redis/replica_ack.ts";
import { announceLane, laneKnownArgs } from "../queue/lanes.ts";
import type { ServiceKeys } from "../runs/keys.ts";
import type { OnlineRun } from "./batch_poller.ts";
import { ONLINE_SCRIPT } from "./batch_online_script.ts";
import { BATCH_ANSWER_FIELD, BATCH_MODEL_FIELD } from "../runs/run_batch.ts";

/** How long the marker outlives the send: longer than a batch's 24 h window and its settling. */
export const ONLINE_MARKER_TTL_S = 7 * 24 * 3600;

/** A batch run's payload as a `low` run: the same run, which no batch takes again. */
export function onlinePayload(payload: string): string {
  return JSON.stringify({ ...JSON.parse(payload), priority: "low" });
}

/**
 * The online hook of the batch poller (`PollerOptions.online`): puts a run on its lane's low stream, once per run
 * id however often it is called. @returns whether this call added the entry.
 */
export function createBatchOnline(
  { redis, keys, ack }: { redis: RedisClient; keys: ServiceKeys; ack?: ReplicaAck },
): (run: OnlineRun) => Promise<boolean> {
  return async ({ runId, tenant, payload, acceptedMs, answer }) => {
    const lane = keys.lane(tenant);
    const known = laneKnownArgs(redis, keys.registry, tenant, lane.stream);
    const fields = [
      "job_id",
      runId,
      "tenant",
      tenant,
      "payload",
      onlinePayload(payload).toWellFormed(),
      // Its age counts from its first acceptance, not from its return to the lane.
      ...(acceptedMs === undefined ? [] : ["accepted_ms", String(acceptedMs)]),
      // A structured run's batch answer, for the worker to check (and repair) rather than call again.
      // Well-formed: a lone surrogate in a provider's answer would make the script's cjson refuse the argument, and
      // the line (and those after it) would never settle.
      ...(answer === undefined
        ? []
        : [BATCH_ANSWER_FIELD, answer.text.toWellFormed(), BATCH_MODEL_FIELD, answer.model]),
    ];
    const scriptKeys = [lane.streamOf("low"), lane.job(runId), lane.batchOnline(runId), ...known.keys];
    const args = [JSON.stringify({
      fields,
      record: ["tenant", tenant, "status", "queued", "priority", "low"],
      marker_ttl_s: ONLINE_MARKER_TTL_S,
      lane: known.lane,
      wake: known.wake,
    })];
    let added: unknown;
    if (ack) {
      const run = await ack.run(ONLINE_SCRIPT, scriptKeys, args);
      if (!run.replicated) throw notReplicated(ack, run.acked);
      added = run.result;
    } else added = await ONLINE_SCRIPT.run(redis, scriptKeys, args);
    if (!known.announced) await announceLane(redis, keys.registry, tenant);
    return added === 1;
  };
}
