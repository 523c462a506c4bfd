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
import { INTAKE_SCRIPT } from "./intake_script.ts";
import { type AckedRun, notReplicated, type ReplicaAck } from "../redis/replica_ack.ts";
import { markQueued } from "./job_status.ts";
import type { LaneKeys, ServiceKeys } from "./keys.ts";
import { announceLane, type LaneKnown, laneKnownArgs } from "../queue/lanes.ts";
import { allLanes } from "./all_lanes.ts";
import type { Logger } from "../log/logger.ts";
import type { SummaryRequest } from "./shapes.ts";

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

/** The intake script's SHA-1, for counting its calls (`INFO commandstats` names only EVALSHA). */
export const INTAKE_SHA = INTAKE_SCRIPT.sha;

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

/** The stored answer to a run's POST, as `JSON.stringify` writes its {@linkcode StoredRecord}, from a template. */
export function runRecord(jobId: string): string {
  return `{"fp":"${jobId}","status":202,"body":{"run_id":"${jobId}","status":"queued"},"headers":{"location":"${RUNS_PATH}/${jobId}"}}`;
}

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
      const lengths = await Promise.all(lanes.map(async ({ keys: lane }) => {
        const each = await Promise.all(lane.streams.map((stream) => redis.xlen(stream)));
        return each.reduce((n, x) => n + x, 0);
      }));
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
  // visible characters) and not hashed, since every hash is paid on the request path (what one costs: README,
  // 'Intake against both baselines, its profile, and all cores', the `uuidV5` row).
  const keyFor = (scope: Scope) => keys.lane(scope.tenant).idempotency(encodeScope(scope));
  /** What the script's submissions of one tenant (and task version) share: their entry in its heads. */
  const headOf = (tenant: string, known: LaneKnown, run?: RunSubmission) =>
    JSON.stringify({ tenant, cap: maxQueuedPerTenant ?? 0, status: markQueued(tenant, run), lane: known.lane });
  /**
   * What a tenant's summary jobs (or runs of one task version) share in the script's call: its lane, the sets
   * that make the lane known, and its head. Built once per tenant (and version), so that a request does not
   * serialise the whole argument (what that cost: README, 'Intake against both baselines, its profile, and all
   * cores', the `enqueue` row).
   */
  const heads = new Map<string, { lane: LaneKeys; known: LaneKnown; head: string }>();
  const headFor = (tenant: string, run?: RunSubmission) => {
    const id = run ? `${tenant}\n${run.task}\n${run.version}` : tenant;
    let found = heads.get(id);
    if (!found) {
      const lane = keys.lane(tenant);
      const known = laneKnownArgs(redis, keys.registry, tenant, lane.stream);
      found = { lane, known, head: headOf(tenant, known, run) };
      if (heads.size >= 10_000) heads.delete(heads.keys().next().value!);
      heads.set(id, found);
    }
    return found;
  };
  const batches = createIntakeBatches(redis, ack, resultTtlS, () => maxQueued ? fullQueueShare() : 0);
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
    const record = run ? runRecord(jobId) : summaryRecord(jobId, path);
    const { lane, known, head } = headFor(scope.tenant, run);
    const { stored, acked } = await batches.submit(
      // On one server every lane's known sets are the same two: one batch for all tenants. On a cluster a batch
      // is one tenant's, its keys in the lane's slot.
      redis.isCluster ? scope.tenant : "",
      known,
      head,
      [keyFor(scope), lane.stream, lane.job(jobId)],
      [jobId, traceparent ?? "", refuse ? "1" : "0", run ? run.payload : payload ?? JSON.stringify(request), record],
    );
    if (stored === 1) throw new QueueFull(`tenant ${scope.tenant}'s queue is full`, RETRY_AFTER_S);
    if (stored === 2) throw new QueueFull("the queue is full", RETRY_AFTER_S);
    if (stored === 3) throw refuse;
    // The script made the lane known (on one server it announced it too), so no crash from here on can
    // hide the job from the workers' sweep. The announce only wakes them now rather than at the sweep:
    // after the enqueue, never before (a worker taking the lane off the active set looks again after).
    // A replay announces too: the client's retry may be all that follows a crash right here.
    await faults?.afterScript?.();
    if (!known.announced || stored !== 0) {
      announceLane(redis, keys.registry, scope.tenant).catch((error) =>
        log?.warn("lane_announce_failed", { tenant: scope.tenant, error })
      );
    }
    const previous = stored === 0 ? null : JSON.parse(stored as string) as StoredRecord;
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

/** Submissions that arrive together share one script call: at most this many in one call. */
const BATCH_MAX = 64;
/** At most about this many bytes of payloads and answers in one call (a larger submission goes alone). */
const BATCH_MAX_BYTES = 512 * 1024;
/** Calls in flight per batch; submissions that arrive meanwhile wait for one to return, and go together. */
const BATCH_IN_FLIGHT = 2;

/** What the script said of one submission, and what the replicas acknowledged of its call. */
interface Outcome {
  stored: string | number;
  acked?: AckedRun;
}

interface Submission {
  head: string;
  keys: string[];
  args: string[];
  bytes: number;
  resolve(outcome: Outcome): void;
  reject(error: unknown): void;
}

/**
 * Group intake: the submissions that arrive while a batch's calls are in flight (or in the same turn of the
 * event loop) go to Redis in one call of the script, as a group commit does. With little load each goes
 * alone, at once; under load, a call and its reply, the script's start and the lane's announcement are paid
 * once per batch rather than once per POST (where an accepted POST's cost goes: README, 'Intake against both
 * baselines, its profile, and all cores', 'Group intake'). Nothing is answered before its own batch's call has
 * returned. With a replica acknowledgement (REDIS_MIN_REPLICAS_ACK) every submission has its call to itself, as
 * before.
 */
function createIntakeBatches(
  redis: RedisClient,
  ack: ReplicaAck | undefined,
  resultTtlS: number,
  share: () => Promise<number> | number,
) {
  const queues = new Map<string, { known: LaneKnown; waiting: Submission[]; inFlight: number; scheduled: boolean }>();
  type Queue = typeof queues extends Map<string, infer Q> ? Q : never;
  const run = async (known: LaneKnown, batch: Submission[]) => {
    try {
      const heads: string[] = [];
      const index = new Map<string, number>();
      const keys = [...known.keys];
      const args = [
        ack ? "1" : "0",
        String(known.keys.length),
        "",
        String(resultTtlS),
        String(await share()),
        known.wake,
      ];
      for (const submission of batch) {
        let head = index.get(submission.head);
        if (head === undefined) {
          heads.push(submission.head);
          index.set(submission.head, head = heads.length);
        }
        keys.push(submission.keys[0]!, submission.keys[1]!, submission.keys[2]!);
        args.push(String(head));
        for (const arg of submission.args) args.push(arg);
      }
      args[2] = `[${heads.join(",")}]`;
      const acked = ack ? await ack.run(INTAKE_SCRIPT, keys, args) : undefined;
      const results =
        (acked ? acked.result : await INTAKE_SCRIPT.run(redis, keys, args)) as (string | number | Error)[];
      if (!Array.isArray(results) || results.length !== batch.length) {
        throw new Error(`The intake script answered ${batch.length} submissions with ${JSON.stringify(results)}`);
      }
      batch.forEach((submission, i) => {
        const stored = results[i];
        if (stored instanceof Error) submission.reject(stored);
        else submission.resolve({ stored: stored!, acked });
      });
    } catch (error) {
      for (const submission of batch) submission.reject(error);
    }
  };
  const flush = (id: string, queue: Queue) => {
    queue.scheduled = false;
    while (queue.waiting.length > 0 && queue.inFlight < BATCH_IN_FLIGHT) {
      let count = 0;
      let bytes = 0;
      while (
        count < queue.waiting.length && count < BATCH_MAX &&
        (count === 0 || bytes + queue.waiting[count]!.bytes <= BATCH_MAX_BYTES)
      ) bytes += queue.waiting[count++]!.bytes;
      queue.inFlight++;
      run(queue.known, queue.waiting.splice(0, count)).finally(() => {
        queue.inFlight--;
        if (queue.waiting.length > 0) flush(id, queue);
        else if (queue.inFlight === 0 && queues.get(id) === queue) queues.delete(id);
      });
    }
  };
  return {
    /**
     * Runs one submission's part of the script (`keys`: its record, stream and status record; `args`: its
     * job id, traceparent, refusal, payload and answer) in the next call of batch `id`, whose submissions all
     * share `known`.
     */
    submit(id: string, known: LaneKnown, head: string, keys: string[], args: string[]): Promise<Outcome> {
      const { promise, resolve, reject } = Promise.withResolvers<Outcome>();
      const submission = { head, keys, args, bytes: args[3]!.length + args[4]!.length, resolve, reject };
      if (ack) {
        // With REDIS_MIN_REPLICAS_ACK each submission keeps its own call: the replica runner bounds its wait (for one
        // of its connections and for the replicas, REDIS_ACK_TIMEOUT_MS), which a queue in front of it would not.
        void run(known, [submission]);
        return promise;
      }
      let queue = queues.get(id);
      if (!queue) queues.set(id, queue = { known, waiting: [], inFlight: 0, scheduled: false });
      queue.waiting.push(submission);
      if (!queue.scheduled && queue.inFlight < BATCH_IN_FLIGHT) {
        queue.scheduled = true;
        const scheduled = queue;
        queueMicrotask(() => flush(id, scheduled));
      }
      return promise;
    },
  };
}
