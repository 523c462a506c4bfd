/**
 * The one-time move off the single `{jobs}` stream of releases before lanes.
 * Every worker runs it when it starts (beside its first reads, never in front
 * of them), so an upgraded deployment loses nothing that was still queued
 * there, with no step for an operator to remember: where the stream does not
 * exist (every deployment after its first upgraded worker), it costs one
 * EXISTS.
 *
 * Every entry still in the stream, new or pending (acked entries are
 * deleted, so everything there is one or the other), is added to its
 * tenant's lane with its fields, its job's status record copied beside it
 * (`GET` reads only the lane's), and the lane made known as intake makes it;
 * then it is deleted from the old stream. Once the stream is read empty, it is
 * deleted with its group, in one step with the check, so an entry added
 * meanwhile is left for the next drain.
 *
 * Lane and old stream are in different cluster slots, so the move cannot be
 * atomic: XADD to the lane, then XDEL from the old stream. A crash between the
 * two leaves the entry in both; the next drain finds the lane's marker for it
 * and does not add it twice. What no marker prevents, a delivery still under
 * way by an old worker while its entry moves, is a duplicate delivery, which
 * the commit path already makes harmless (the job_outcomes primary key: the
 * second delivery commits nothing and sends nothing).
 */
import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import { sleep } from "../async/timeout.ts";
import { announceLane, laneKnownArgs } from "../queue/lanes.ts";
import { deleteEmptyStream } from "../queue/delete_empty_stream_script.ts";
import { entriesAfter } from "../queue/message.ts";
import { fieldsToObject } from "../redis/fields.ts";
import { MOVE_INTO_LANE_SCRIPT } from "./move_into_lane_script.ts";
import type { ServiceKeys } from "./keys.ts";

/** Defaults of {@linkcode drainLegacyStream}. */
export const LEGACY_DRAIN_DEFAULTS = {
  /** Entries read from the old stream at a time. */
  batch: 100,
  /** How long a lane remembers that it took an entry, so a drain that crashed before the XDEL does not add it twice. */
  markerTtlS: 7 * 24 * 3600,
  /**
   * How often a running worker looks at the old stream again (one EXISTS once it is gone): an API of a release
   * before lanes, still running during a rolling upgrade, may write there after the first drain.
   */
  recheckMs: 30_000,
} as const;

/**
 * Moves every entry of the pre-lane `{jobs}` stream under `keys.prefix` into its tenant's lane, then deletes
 * the stream once it is empty. Safe to run from several workers at once. An entry that names no tenant or job
 * is left where it is (logged), and the stream with it. @returns how many entries were taken off the old stream
 * (one a crashed drain had already added to its lane is counted, not added again).
 */
export async function drainLegacyStream(
  { redis, log }: { redis: RedisClient; log: Logger },
  { keys, batch = LEGACY_DRAIN_DEFAULTS.batch, signal }: { keys: ServiceKeys; batch?: number; signal?: AbortSignal },
): Promise<number> {
  const legacy = keys.legacy;
  if ((await redis.exists(legacy.stream)) === 0) return 0;
  let moved = 0;
  let from = "-";
  // A stopping worker stops between entries; the next start goes on where this one left off.
  while (!signal?.aborted) {
    const entries = await entriesAfter(redis, legacy.stream, from, batch);
    if (entries.length === 0) break;
    for (const [id, flat] of entries) {
      from = id;
      const { tenant, job_id: jobId } = fieldsToObject(flat);
      if (!tenant || !jobId) {
        log.error("legacy_entry_unroutable", { stream: legacy.stream, msg_id: id });
        continue;
      }
      const lane = keys.lane(tenant);
      const record = await redis.hgetall(legacy.job(jobId));
      const known = laneKnownArgs(redis, keys.registry, tenant, lane.stream);
      await MOVE_INTO_LANE_SCRIPT.run(redis, [lane.stream, lane.job(jobId), lane.movedFromLegacy(id), ...known.keys], [
        JSON.stringify({
          fields: flat,
          record: Object.entries(record).flat(),
          // Its job is queued in its lane now: the record lives as long as it waits there (see `markQueued`).
          record_ttl_ms: 0,
          marker_ttl_s: LEGACY_DRAIN_DEFAULTS.markerTtlS,
          lane: known.lane,
          wake: known.wake,
        }),
      ]);
      // Only after the lane has it: a crash before this line leaves a duplicate, never a loss.
      await redis.multi().xack(legacy.stream, legacy.group, id).xdel(legacy.stream, id).exec();
      if (!known.announced) await announceLane(redis, keys.registry, tenant);
      moved++;
    }
  }
  if (signal?.aborted) return moved;
  if (await deleteEmptyStream(redis, legacy.stream)) {
    log.info("legacy_stream_drained", { stream: legacy.stream, moved });
  } else if (moved > 0) {
    log.warn("legacy_stream_not_empty", { stream: legacy.stream, moved });
  }
  return moved;
}

/**
 * Drains the old stream now and again every `recheckMs` until `signal` aborts. A failed drain is logged
 * (`legacy_drain_failed`) and tried again at the next look.
 */
export async function keepDrainingLegacyStream(
  deps: { redis: RedisClient; log: Logger },
  { keys, signal, recheckMs = LEGACY_DRAIN_DEFAULTS.recheckMs }: {
    keys: ServiceKeys;
    signal: AbortSignal;
    recheckMs?: number;
  },
): Promise<void> {
  while (!signal.aborted) {
    await drainLegacyStream(deps, { keys, signal }).catch((error) => deps.log.error("legacy_drain_failed", { error }));
    await sleep(recheckMs, signal).catch(() => {});
  }
}
