/**
 * The key book: every Redis key name of the run pipeline is built here, under
 * one prefix, and nowhere else. A tenant's keys share the hash tag
 * `{t:<tenant>}`, spelled once ({@linkcode tenantTag}), so every MULTI or
 * script on one tenant's keys stays in one Redis Cluster slot while tenants
 * spread over all of them:
 *
 * - its lane ({@linkcode LaneKeys}): the streams, in the order a read takes
 *   from them (the default lane has one, `…:stream`), and the dead letters;
 * - beside them, its jobs' status records and its idempotency records (one
 *   hash per period of their lifetime), which the intake script writes in
 *   the same step as the stream;
 * - its result cache's entries and their locks;
 * - its budget hash and its refusal counters.
 *
 * The lane registry has a slot of its own (`queue/lanes.ts` names its keys
 * under the prefix). The folders that use these keys type what they take in
 * their own modules (`queue/`'s `LaneNames`, `cache/`'s `CacheKeys`,
 * `metrics/`'s `RefusalKeys`, the budgets' builder of the budget hash):
 * {@linkcode ServiceKeys} satisfies each, and none of them imports this
 * module. A deployed Redis holds these names: none may change.
 */
import type { CacheKeys } from "../cache/result_cache.ts";
import type { BacklogKeys } from "../queue/backlog.ts";
import { type LaneRegistryKeys, laneRegistryKeys } from "../queue/lanes.ts";
import type { LaneNames, QueueNames } from "../queue/message.ts";
import { TenantMap } from "../tenants/tenant_map.ts";

/** The prefix of every Redis key the service writes. */
export const KEY_PREFIX = "oncely";

/**
 * The most bytes (estimated: `tenants/tenant_map.ts`) of lanes' names one key book keeps, about 480 bytes each with
 * a name of 10 characters ({@linkcode LANE_KEYS_BYTES_EACH}): some 34,000 tenants. Past it the oldest are built
 * again when asked for (a count of 10,000 built one per request at 20,000 tenants); the intake keeps its own with
 * its heads.
 */
export const LANE_KEYS_BYTES = 16 * 1024 * 1024;
/**
 * A lane's names beyond its tenant's name and its entry: measured at 457 bytes a lane with both (a name of 10 or 11
 * characters, 20,000 lanes; 1,154 when its builders were closures).
 */
const LANE_KEYS_BYTES_EACH = 360;

/** The consumer group on every stream of every lane (named before runs were). */
const GROUP = "summarisers";

/** The stream intake adds to, after the tenant's tag: in every lane. */
const INTAKE_STREAM = "stream";

/**
 * A run's priority (`priority` of `POST /v1/tasks/{name}/runs`; a `batch` run is queued as `low` unless a provider
 * batch takes it).
 */
export type Priority = "high" | "normal" | "low";

/** The stream of each priority, by its name after the tenant's tag: `normal` is intake's stream of old. */
const PRIORITY_STREAMS: Record<Priority, string> = { high: "high", normal: INTAKE_STREAM, low: "low" };

/**
 * Each priority's share of its lane's takes while several have runs waiting (stride scheduling, see
 * `take_within_cap_script.ts`): high runs go 16 to every 4 normal and 1 low, so each overtakes the lower ones'
 * backlog and none is starved. A lane's share of the worker (between tenants) does not change with them.
 */
export const PRIORITY_SHARES: Readonly<Record<string, number>> = { high: 16, [INTAKE_STREAM]: 4, low: 1 };

/**
 * The streams of a lane, by their names after the tenant's tag: one per priority. The first names the lane in the
 * registry and the workers (`laneId`), so it stays intake's stream of the releases that had only it.
 */
export const DEFAULT_LANE_STREAMS: readonly string[] = [INTAKE_STREAM, PRIORITY_STREAMS.high, PRIORITY_STREAMS.low];

/** A tenant's lane, and the records kept beside it (in its hash tag). */
export interface LaneKeys extends LaneNames, QueueNames {
  /** The stream of `normal` runs: summaries and runs without a priority, and a dead letter's replay. */
  stream: string;
  /** The lane's streams: one per priority (see {@linkcode DEFAULT_LANE_STREAMS}). */
  streams: readonly string[];
  /** The stream a run of `priority` is queued on: one of `streams` (`normal`'s when the lane has no other). */
  streamOf(priority: Priority | undefined): string;
  /** The lane's dead letters (of all its streams). */
  dead: string;
  /** The consumer group on each of the lane's streams. */
  group: string;
  /** Hash with the job's tenant and status, read by `GET /v1/runs/{id}` (`job_status.ts` writes it). */
  job(jobId: string): string;
  /**
   * The idempotency records written in period `index` (periods of `periodS` seconds since the epoch): a hash, one
   * field per scope (see `intake_script.ts`), in the same slot as the stream it enqueues to.
   */
  idempotencyRecords(periodS: number, index: number): string;
  /**
   * The stored answer for an Idempotency-Key scope (its encoding) as releases before issue 39 wrote it, one
   * string key per scope: intake still reads it until it expires (`IDEMPOTENCY_RESULT_TTL_S` after the upgrade).
   */
  idempotency(scope: string): string;
  /** Marks that the pre-lane stream's entry `entryId` was moved into this lane (see `legacy_drain.ts`). */
  movedFromLegacy(entryId: string): string;
  /**
   * Marks that batch run `runId` was put back on this lane's low stream (the Batch API's online path, see
   * `batches/batch_online.ts`): written in the same script as its entry, so a second send adds nothing.
   */
  batchOnline(runId: string): string;
}

/**
 * The single `{jobs}` stream of releases before lanes, under the service's prefix, and its jobs' status records:
 * only the workers' legacy drain reads it, to empty it into the lanes (see `legacy_drain.ts`).
 */
export interface LegacyKeys extends QueueNames {
  job(jobId: string): string;
}

/** Every key name the service uses under a prefix. */
export interface ServiceKeys {
  prefix: string;
  /** Tenant `tenant`'s lane and the records beside it. */
  lane(tenant: string): LaneKeys;
  /** Tenant `tenant`'s result cache entries and their locks (`cache/`'s `CacheKeys`). */
  cache(tenant: string): CacheKeys;
  /** Tenant `tenant`'s budget hash: its spend, reservations and marks. */
  budget(tenant: string): string;
  /** The hash of tenant `tenant`'s refusals in UTC hour `hour`, hours since the epoch (`metrics/`' `RefusalKeys`). */
  refusals(tenant: string, hour: number): string;
  /** The registry of lanes with work. */
  registry: LaneRegistryKeys;
  /** The backlog's snapshot over every lane and its walker's lease (`queue/backlog.ts`), in the registry's slot. */
  backlog: BacklogKeys;
  /** The pre-lane stream, for the legacy drain alone. */
  legacy: LegacyKeys;
}

/** Options for {@linkcode serviceKeys}. */
export interface ServiceKeysOptions {
  /**
   * Each lane's streams, by their names after the tenant's tag, in the order a read takes from them; they must
   * include intake's `stream`. Default {@linkcode DEFAULT_LANE_STREAMS}.
   */
  laneStreams?: readonly string[];
}

/** The start of every key of `tenant`'s: the prefix and the tenant's hash tag. The one place the tag is spelled. */
function tenantTag(prefix: string, tenant: string): string {
  return joined(prefix, ":{t:", tenant, "}");
}

/**
 * The service's keys under a prefix: {@linkcode KEY_PREFIX} in the service, a random one in tests.
 * @throws {TypeError} if `laneStreams` is empty, names a stream twice, or lacks intake's `stream`.
 */
export function serviceKeys(
  prefix: string,
  { laneStreams = DEFAULT_LANE_STREAMS }: ServiceKeysOptions = {},
): ServiceKeys {
  if (!laneStreams.includes(INTAKE_STREAM) || new Set(laneStreams).size !== laneStreams.length) {
    throw new TypeError(
      `A lane's streams must be distinct and include "${INTAKE_STREAM}" (got ${JSON.stringify(laneStreams)})`,
    );
  }
  const lanes = new TenantMap<LaneKeys>(LANE_KEYS_BYTES, () => LANE_KEYS_BYTES_EACH);
  const shape = laneShape(laneStreams);
  const legacyTag = `${prefix}:{jobs}`;
  return {
    prefix,
    lane(tenant) {
      let keys = lanes.get(tenant);
      if (!keys) {
        keys = new Lane(tenantTag(prefix, tenant), shape);
        lanes.set(tenant, keys);
      }
      return keys;
    },
    cache(tenant) {
      const tag = tenantTag(prefix, tenant);
      return { entry: (keyHash) => `${tag}:cache:${keyHash}`, lock: (keyHash) => `${tag}:cache_lock:${keyHash}` };
    },
    budget: (tenant) => `${tenantTag(prefix, tenant)}:budget`,
    refusals: (tenant, hour) => `${tenantTag(prefix, tenant)}:refusals:${hour}`,
    registry: laneRegistryKeys(prefix),
    backlog: { snapshot: `${prefix}:{lanes}:backlog`, lease: `${prefix}:{lanes}:backlog_lease` },
    legacy: {
      stream: `${legacyTag}:stream`,
      dead: `${legacyTag}:dead`,
      group: GROUP,
      job: (jobId) => jobUnder(legacyTag, jobId),
    },
  };
}

/**
 * What every lane of a key book shares: its streams' names after the tag, their shares, and each priority's index
 * among them (one the lane lacks: its intake stream's).
 */
interface LaneShape {
  streams: readonly string[];
  shares: readonly number[];
  byPriority: Readonly<Record<Priority, number>>;
}

function laneShape(streams: readonly string[]): LaneShape {
  const intake = streams.indexOf(INTAKE_STREAM);
  const of = (p: Priority) => streams.includes(PRIORITY_STREAMS[p]) ? streams.indexOf(PRIORITY_STREAMS[p]) : intake;
  return {
    streams: Object.freeze([...streams]),
    shares: Object.freeze(streams.map((name) => PRIORITY_SHARES[name] ?? 1)),
    byPriority: { high: of("high"), normal: of("normal"), low: of("low") },
  };
}

/** One string of `parts`, flat: a template literal's is a rope, a V8 object more per name for every lane kept. */
function joined(...parts: string[]): string {
  return parts.join("");
}

/**
 * A lane's names, as few objects as can be (issue 39): a process keeps one per tenant in use (the API's intake
 * heads, a worker's lanes), and every object kept is work for each full collection of V8's heap, which stalls the
 * process (at 20,000 tenants, 20 to 40 ms several times in a row every few seconds under load: the intake's p99).
 * A lane of one closure per builder was some 30 objects and 1,154 bytes; this one is 457 bytes. Its builders are
 * methods, its strings flat, and what every lane has alike (the streams' shares, the priorities' places) is the
 * key book's. Its methods read `this`: call them on the lane (`lane.job(id)`), never detached.
 */
class Lane implements LaneKeys {
  readonly stream: string;
  readonly streams: readonly string[];
  readonly priorityState: string;
  readonly dead: string;
  readonly group = GROUP;
  readonly shares: readonly number[];

  constructor(private readonly tag: string, private readonly shape: LaneShape) {
    this.streams = shape.streams.map((name) => joined(tag, ":", name));
    this.shares = shape.shares;
    this.stream = this.streams[shape.streams.indexOf(INTAKE_STREAM)]!;
    this.priorityState = joined(tag, ":priority");
    this.dead = joined(tag, ":dead");
  }

  // A priority unknown to the type (an unchecked caller's) queues on the intake stream, as before.
  streamOf(priority: Priority = "normal"): string {
    return Object.hasOwn(this.shape.byPriority, priority)
      ? this.streams[this.shape.byPriority[priority]]!
      : this.stream;
  }

  job(jobId: string): string {
    return jobUnder(this.tag, jobId);
  }

  idempotencyRecords(periodS: number, index: number): string {
    // Flat: intake keeps a period's names with its head.
    return joined(this.tag, ":idem_records:", String(periodS), ":", String(index));
  }

  idempotency(scope: string): string {
    return `${this.tag}:idem:${scope}`;
  }

  movedFromLegacy(entryId: string): string {
    return `${this.tag}:moved:${entryId}`;
  }

  batchOnline(runId: string): string {
    return `${this.tag}:batch_online:${runId}`;
  }
}

/**
 * The status record of `jobId` beside `laneKey`, any key of a lane (a stream, its dead letters): every key of a
 * lane starts with the prefix and the lane's hash tag, and the record is under the same.
 * @throws {TypeError} if `laneKey` has no hash tag.
 */
export function jobKeyBeside(laneKey: string, jobId: string): string {
  // Redis's own rule: the tag is up to the first `}` after the first `{` (a tenant's name holds neither).
  const open = laneKey.indexOf("{");
  const close = open < 0 ? -1 : laneKey.indexOf("}", open + 1);
  if (close < 0) throw new TypeError(`Not a key of a lane: ${JSON.stringify(laneKey)}`);
  return jobUnder(laneKey.slice(0, close + 1), jobId);
}

/** A job's status record under a lane's `<prefix>:{<tag>}`. */
function jobUnder(tag: string, jobId: string): string {
  return `${tag}:job:${jobId}`;
}

/** How long a job's status record lives in Redis (the summary itself lives in Postgres). */
export const JOB_RECORD_TTL_S = 7 * 24 * 3600;
