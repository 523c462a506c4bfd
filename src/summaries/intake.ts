/**
 * Intake in one round trip: the idempotency check, the enqueue, the job's
 * status record and the stored response happen in one Lua script, so no
 * crash can leave a key "in progress" and a concurrent duplicate simply finds
 * the first request's record (Redis runs scripts one at a time).
 */
import type { RedisClient } from "../clients.ts";
import { KeyReused } from "../idempotency/errors.ts";
import { canonicalJson } from "../idempotency/fingerprint.ts";
import { encodeScope, jobIdFor, type Scope } from "../idempotency/scope.ts";
import { defineScript } from "../redis/script.ts";
import { notReplicated, type ReplicaAck } from "../redis/replica_ack.ts";
import { markQueued } from "./job_status.ts";
import type { JobKeys, ServiceKeys } from "./keys.ts";
import { announceLane, type LaneKnown, laneKnownArgs } from "../queue/lanes.ts";
import { allLanes } from "./all_lanes.ts";
import type { Logger } from "../log/logger.ts";
import type { SummaryRequest } from "./schemas.ts";

/** The stored answer to an accepted POST, replayed for the key's lifetime. */
export interface IntakeResponse {
  status: number;
  body: { job_id: string; status: "queued" } | { run_id: string; status: "queued" };
  headers: Record<string, string>;
}

/** A task run to enqueue (a summary job is the request alone). */
export interface RunSubmission {
  task: string;
  version: number;
  /** The stream payload (`RunPayload`'s JSON): the request with its version resolved. */
  payload: string;
}

/** What one submission came to. */
export interface IntakeResult {
  response: IntakeResponse;
  /** The job (or run) the scope and body name. */
  jobId: string;
  /** The key had been used with this body before: `response` is the stored one and nothing was enqueued. */
  replayed: boolean;
}

/** Accepts summary jobs at most once per Idempotency-Key scope. */
export interface Intake {
  /**
   * Enqueues the job unless the scope already has a record.
   * @throws {KeyReused} when the scope's record is for another body.
   */
  submit(
    input: {
      scope: Scope;
      request: SummaryRequest;
      traceparent?: string;
      /** The stream payload (`summaryPayload`); the request's JSON when unset. Never part of the fingerprint. */
      payload?: string;
      /** `canonicalJson(request)`, when the caller has it already (`summaryForms`); computed when unset. */
      canonical?: string;
      /** Refuse a new job with this error (a spent budget); a replay of the key is still answered. */
      refuse?: Error;
    },
  ): Promise<IntakeResult>;
  /**
   * Enqueues a task run unless the scope already has a record: `request` (the body as the client sent it)
   * is the fingerprint, `run.payload` what the worker reads; the answer names a run at `/v1/runs/{id}`.
   * @throws {KeyReused} when the scope's record is for another body.
   */
  submitRun(
    input: { scope: Scope; request: unknown; run: RunSubmission; traceparent?: string; refuse?: Error },
  ): Promise<IntakeResult>;
  /** The Redis key of a scope's record. */
  keyFor(scope: Scope): string;
}

// INTAKE: the idempotency check, the enqueue, the job's status record and the stored answer, in one step.
// KEYS[1]   the scope's idempotency record.
// KEYS[2]   the lane's stream.
// KEYS[3]   the job's status record (the three share the lane's hash tag).
// KEYS[4…]  the registry sets that make the lane known (`laneKnownArgs`): its home on a cluster.
// ARGV[1]   JSON: { job_id, tenant, traceparent ('' when not tracing: the message then has no such field),
//           record_ttl_s (the stored answer's lifetime), cap (the lane's cap, 0 = none), share (the lane's share
//           of a full queue, 0 = the queue is not full), status (the status record's change, `markQueued`),
//           lane (the lane id), wake (the channel to publish it on, '' for none), refuse (1: a new job is refused,
//           the tenant's budget is spent; a replay is still answered) }.
// ARGV[2]   the payload (the request's JSON).
// ARGV[3]   the stored answer (the record).
// ARGV[4]   '1' when a WAIT follows (REDIS_MIN_REPLICAS_ACK): a found record is then written again, expiry
//           unchanged, because WAIT covers only its own connection's writes and the record may have been
//           written on another one (a first attempt answered 503, another API process) and not replicated yet.
// Returns the existing record (or ours, stored again, when the key's record expired but the job is still
// known: it is not enqueued twice and its status is left alone), 1 when the lane is full, 2 when the whole
// queue is full and this lane holds its share of it, 3 when refused (nothing written in these), or false after enqueuing,
// making the lane known and storing ours.
const INTAKE = defineScript(`
local stored = redis.call('GET', KEYS[1])
if stored then
  if ARGV[4] == '1' then
    local at = redis.call('PEXPIRETIME', KEYS[1])
    if at > 0 then redis.call('PEXPIREAT', KEYS[1], at) end
  end
  return stored
end
local a = cjson.decode(ARGV[1])
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('SET', KEYS[1], ARGV[3], 'EX', a.record_ttl_s)
  return ARGV[3]
end
if a.refuse == 1 then return 3 end
if a.cap > 0 and redis.call('XLEN', KEYS[2]) >= a.cap then return 1 end
if a.share > 0 and redis.call('XLEN', KEYS[2]) >= a.share then return 2 end
if a.traceparent ~= '' then
  redis.call('XADD', KEYS[2], '*', 'job_id', a.job_id, 'tenant', a.tenant, 'payload', ARGV[2], 'traceparent', a.traceparent)
else
  redis.call('XADD', KEYS[2], '*', 'job_id', a.job_id, 'tenant', a.tenant, 'payload', ARGV[2])
end
-- The record is new (EXISTS said so above): it has no field to delete (a.status.del).
redis.call('HSET', KEYS[3], unpack(a.status.set))
redis.call('EXPIRE', KEYS[3], a.status.ttl_s)
for i = 4, #KEYS do redis.call('SADD', KEYS[i], a.lane) end
if a.wake ~= '' then redis.call('PUBLISH', a.wake, a.lane) end
redis.call('SET', KEYS[1], ARGV[3], 'EX', a.record_ttl_s)
return false`);

type StoredRecord = { fp: string } & IntakeResponse;

/**
 * A summary job's stored answer, as `JSON.stringify` writes its record (`{fp, status, body, headers}`); the job
 * id is a UUID and needs no escaping.
 */
export function summaryRecord(jobId: string, path: string): string {
  return `{"fp":"${jobId}","status":202,"body":{"job_id":"${jobId}","status":"queued"},"headers":{"location":${
    JSON.stringify(`${path}/${jobId}`)
  }}}`;
}

/** Where runs live: a run's answer points to `/v1/runs/{run_id}`. */
const RUNS_PATH = "/v1/runs";

/** How long a client told "full" should wait before trying again. */
const RETRY_AFTER_S = 5;

/** The queue (or one tenant's lane) holds its cap of jobs; nothing was written, so the client may retry. */
export class QueueFull extends Error {
  constructor(message: string, readonly retryAfterS: number) {
    super(message);
    this.name = "QueueFull";
  }
}

/** Test seams: each runs at its point of `submit`, and may throw to stand in for a crash there. */
export interface IntakeFaults {
  /** After the intake script, before the announce. */
  afterScript?(): Promise<void>;
}

/**
 * Creates the intake on `redis`; records live `resultTtlS` (IDEMPOTENCY_RESULT_TTL_S). With `ack`
 * (REDIS_MIN_REPLICAS_ACK), the script and a WAIT share one round trip, and an answer is given only once the
 * replicas have the record: a new job's, or a replayed one's.
 */
export function createIntake(
  { redis, log, faults, ack }: { redis: RedisClient; log?: Logger; faults?: IntakeFaults; ack?: ReplicaAck },
  { keys, resultTtlS, path, maxQueued, maxQueuedPerTenant }: {
    keys: ServiceKeys;
    resultTtlS: number;
    path: string;
    /** INTAKE_MAX_QUEUED: above it (all lanes together), POSTs are refused with 503. */
    maxQueued?: number;
    /** INTAKE_MAX_QUEUED_PER_TENANT: above it (one lane), that tenant's POSTs are refused with 503. */
    maxQueuedPerTenant?: number;
  },
): Intake {
  let total = { at: -Infinity, value: 0, lanes: 0 };
  const totalQueued = async () => {
    // Read at most once a second while the queue is under its cap; every time once it is over, so the lanes'
    // shares follow the queue as it is, not as it was up to a second ago.
    if (performance.now() - total.at > 1_000 || (maxQueued !== undefined && total.value >= maxQueued)) {
      const lanes = await allLanes(redis, keys);
      const lengths = await Promise.all(lanes.map((lane) => redis.xlen(lane.keys.stream)));
      total = {
        at: performance.now(),
        value: lengths.reduce((n, x) => n + x, 0),
        lanes: lengths.filter((n) => n > 0).length,
      };
    }
    return total;
  };
  /**
   * With INTAKE_MAX_QUEUED: 0 while the queue is under it; once it is full, each lane's share of it (the cap
   * split between the lanes holding work, and one more lane: the tenant asking may be new). A tenant under
   * its share is still served, so one tenant filling the queue cannot lock the others out; a replay is
   * answered whatever the queue holds (the script looks for the stored record first).
   */
  const fullQueueShare = async () => {
    if (!maxQueued) return 0;
    const { value, lanes } = await totalQueued();
    return value >= maxQueued ? Math.max(1, Math.floor(maxQueued / (lanes + 1))) : 0;
  };
  // The scope's unambiguous encoding is the key: bounded (a validated tenant name and a key of at most 128
  // visible characters) and not hashed, since every hash costs the request path several microseconds.
  const keyFor = (scope: Scope) => keys.lane(scope.tenant).idempotency(encodeScope(scope));
  /** The fields of the script's JSON argument that do not change from one job of the tenant to the next. */
  const argumentHead = (tenant: string, known: LaneKnown, run?: RunSubmission) =>
    JSON.stringify({
      tenant,
      record_ttl_s: resultTtlS,
      cap: maxQueuedPerTenant ?? 0,
      status: markQueued(tenant, run),
      lane: known.lane,
      wake: known.wake,
    }).slice(0, -1);
  /**
   * What a tenant's summary jobs share in the script's call: its lane, the sets that make the lane known, and
   * the head of the JSON argument (every field but the job's own). Built once per tenant: serialising the whole
   * argument per request was most of `enqueue`'s own time in a `--cpu-prof` under load.
   */
  const tenants = new Map<string, { lane: JobKeys; known: LaneKnown; head: string }>();
  const summaryTenant = (tenant: string) => {
    let found = tenants.get(tenant);
    if (!found) {
      const lane = keys.lane(tenant);
      const known = laneKnownArgs(redis, keys.registry, tenant, lane.stream);
      found = { lane, known, head: argumentHead(tenant, known) };
      if (tenants.size >= 10_000) tenants.delete(tenants.keys().next().value!);
      tenants.set(tenant, found);
    }
    return found;
  };
  const enqueue = async (
    { scope, request, traceparent, run, payload, refuse, canonical }: {
      scope: Scope;
      request: unknown;
      traceparent?: string;
      run?: RunSubmission;
      /** Refuse a new job with this error (a spent budget); a replay of the key is still answered. */
      refuse?: Error;
      payload?: string;
      canonical?: string;
    },
  ): Promise<IntakeResult> => {
    // One hash covers the scope and the body's canonical JSON: the job id. A key reused with another body
    // after its record expired therefore names a new job, never the old job's result, and the job id is
    // the body's fingerprint in the stored record.
    const jobId = jobIdFor(scope, canonical ?? canonicalJson(request));
    const fingerprint = jobId;
    const response: IntakeResponse = run
      ? { status: 202, body: { run_id: jobId, status: "queued" }, headers: { location: `${RUNS_PATH}/${jobId}` } }
      : { status: 202, body: { job_id: jobId, status: "queued" }, headers: { location: `${path}/${jobId}` } };
    const record = run
      ? JSON.stringify({ fp: fingerprint, ...response } satisfies StoredRecord)
      : summaryRecord(jobId, path);
    let lane: JobKeys, known: LaneKnown, head: string;
    if (run) {
      lane = keys.lane(scope.tenant);
      known = laneKnownArgs(redis, keys.registry, scope.tenant, lane.stream);
      head = argumentHead(scope.tenant, known, run);
    } else {
      ({ lane, known, head } = summaryTenant(scope.tenant));
    }
    // The whole queue's size is known only across lanes (other slots), so it is read at most once a second.
    const share = maxQueued ? await fullQueueShare() : 0;
    const scriptKeys = [keyFor(scope), lane.stream, lane.job(jobId), ...known.keys];
    const args = [
      // The head, then the job's own fields: `cjson.decode` reads them in any order.
      `${head},"job_id":"${jobId}","traceparent":${JSON.stringify(traceparent ?? "")},"refuse":${
        refuse ? 1 : 0
      },"share":${share}}`,
      run ? run.payload : payload ?? JSON.stringify(request),
      record,
      ack ? "1" : "0",
    ];
    const acked = ack ? await ack.run(INTAKE, scriptKeys, args) : undefined;
    const stored = (acked ? acked.result : await INTAKE.run(redis, scriptKeys, args)) as string | number | null;
    if (stored === 1) throw new QueueFull(`tenant ${scope.tenant}'s queue is full`, RETRY_AFTER_S);
    if (stored === 2) throw new QueueFull("the queue is full", RETRY_AFTER_S);
    if (stored === 3) throw refuse;
    // The script made the lane known (on one server it announced it too), so no crash from here on can
    // hide the job from the workers' sweep. The announce only wakes them now rather than at the sweep:
    // after the enqueue, never before (a worker taking the lane off the active set looks again after).
    // A replay announces too: the client's retry may be all that follows a crash right here.
    await faults?.afterScript?.();
    if (!known.announced || stored !== null) {
      announceLane(redis, keys.registry, scope.tenant).catch((error) =>
        log?.warn("lane_announce_failed", { tenant: scope.tenant, error })
      );
    }
    const previous = stored === null ? null : JSON.parse(stored as string) as StoredRecord;
    // A reused key is refused whatever the replicas hold: nothing of this request's was written.
    if (previous && previous.fp !== fingerprint) throw new KeyReused();
    // Not promised until the replicas have it. The record may stay on the primary: the client's retry with
    // the same key then finds it (a replay, waited for again) or, if a failover lost it, enqueues the job
    // under the same id; either way one job id, and the commit's primary key on it keeps its effects to one.
    if (ack && acked && !acked.replicated) throw notReplicated(ack, acked.acked);
    if (previous === null) return { response, replayed: false, jobId };
    const { status, body, headers } = previous;
    return { response: { status, body, headers }, replayed: true, jobId };
  };
  return {
    keyFor,
    submit: enqueue,
    submitRun: enqueue,
  };
}
