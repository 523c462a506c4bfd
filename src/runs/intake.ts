/**
 * Intake in one round trip: the idempotency check, the enqueue, the job's
 * status record and the idempotency record happen in one Lua script, so no
 * crash can leave a key "in progress" and a concurrent duplicate simply finds
 * the first request's record (Redis runs scripts one at a time). A record
 * holds the job's fingerprint and its expiry, not the answer: the answer to a
 * replay is rebuilt from the job id, byte for byte the first one's (what a
 * record costs, and why: README, issue 39's "Fewer bytes per queued job").
 */
import type { RedisClient } from "../clients.ts";
import { KeyReused } from "../idempotency/errors.ts";
import { canonicalJson } from "../idempotency/fingerprint.ts";
import { encodeScope, jobIdFor, type Scope, scopeDigest } from "../idempotency/scope.ts";
import type { Clock } from "../retry/clock.ts";
import { INTAKE_SCRIPT } from "./intake_script.ts";
import { type AckedRun, notReplicated, type ReplicaAck } from "../redis/replica_ack.ts";
import { markQueued } from "./job_status.ts";
import type { LaneKeys, Priority, ServiceKeys } from "./keys.ts";
import { announceLane, type LaneKnown, laneKnownArgs } from "../queue/lanes.ts";
import { allLanes } from "./all_lanes.ts";
import { TenantMap } from "../tenants/tenant_map.ts";
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
  /** Its priority: the stream of its lane it is queued on (`LaneKeys.streamOf`); normal when unset. */
  priority?: Priority;
  /** The priority the request asked for (`batch` is queued as low), as its status record names it. */
  requested?: string;
}

/** What one submission came to. */
export interface IntakeResult {
  response: IntakeResponse;
  /** The job (or run) the scope and body name. */
  jobId: string;
  /** The key had been used with this body before: `response` is the stored one and nothing was enqueued. */
  replayed: boolean;
}

/**
 * The most bytes (estimated: `tenants/tenant_map.ts`) of the intake's per-tenant heads, about 850 bytes each with
 * their lane's names ({@linkcode HEAD_BYTES}) and JSON: some 55,000 tenants (and task versions) in use. A head is
 * only work saved: past the bound, the oldest are built again.
 */
export const HEADS_BYTES = 48 * 1024 * 1024;
/**
 * A head's estimate beyond its JSON: its lane's names (`keys.lane()`, measured at 457 bytes with its entry for a
 * tenant of 10 characters), its records hashes' names of the period (three of about 50 characters) and the objects
 * that hold them. On one server every head shares the registry's arguments.
 */
const HEAD_BYTES = 600;
/** On a cluster, what a head holds besides: its own registry arguments (its lane's home set's name, in an array). */
const KNOWN_BYTES = 200;

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
  /**
   * Whether the scope has a record that has not expired, on `on` (a replica, a cluster node; default the intake's
   * client), in either form: tests look at the records through this and {@linkcode Intake.forget}.
   */
  hasRecord(scope: Scope, on?: RedisClient): Promise<boolean>;
  /** Removes the scope's record, in either form, as its expiry does. */
  forget(scope: Scope): Promise<void>;
}

/** The intake script's SHA-1, for counting its calls (`INFO commandstats` names only EVALSHA). */
export const INTAKE_SHA = INTAKE_SCRIPT.sha;

/**
 * A record as releases before issue 39 stored it, one string key per scope: the answer, and the job id as its
 * fingerprint (`{fp, status, body, headers}`). Still read, until the last of them expires.
 */
type StoredRecord = { fp: string } & IntakeResponse;

/** Where runs live: a run's answer points to `/v1/runs/{run_id}`. */
const RUNS_PATH = "/v1/runs";

/**
 * The job's fingerprint in its scope's record: the job id's first 16 hex digits (60 bits of the hash, beside the
 * version digit). It tells a replay (the same body names the same job) from a key used with another body.
 */
export function jobFingerprint(jobId: string): string {
  return `${jobId.slice(0, 8)}${jobId.slice(9, 13)}${jobId.slice(14, 18)}`;
}

/**
 * The records' period at `nowMs` (a period lasts their lifetime, `ttlS`), and its hash's lifetime once it has a
 * record: to the end of the next period, when the last record it can hold expires, and then the shorter of a minute
 * and a period (a margin for the API processes' clocks, and for the next period's first record to unlink it).
 */
function recordPeriod(ttlS: number, nowMs: number): { index: number; keepS: number } {
  const index = Math.floor(nowMs / (ttlS * 1000));
  return { index, keepS: (index + 2) * ttlS - Math.floor(nowMs / 1000) + Math.min(ttlS, 60) };
}

/**
 * Where a scope's record is looked for in period `index`: the lane's records hashes of that period and of the
 * one before, and the one before that (which the first record of the period unlinks).
 */
function recordHashes(lane: LaneKeys, ttlS: number, index: number): string[] {
  return [index, index - 1, index - 2].map((i) => lane.idempotencyRecords(ttlS, i));
}

/** A head's records hashes in period `index` (see `recordHashes`), built once per period and kept with the head. */
function recordsOf(head: Head, ttlS: number, index: number): string[] {
  if (head.records?.index !== index) head.records = { index, keys: recordHashes(head.lane, ttlS, index) };
  return head.records.keys;
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
 * With INTAKE_MAX_QUEUED: 0 while the queue is under it; once it is full, each lane's share of it (the cap
 * split between the lanes holding work, and one more lane: the tenant asking may be new). A tenant under
 * its share is still served, so one tenant filling the queue cannot lock the others out; a replay is
 * answered whatever the queue holds (the script looks for the stored record first).
 */
function queueShare(redis: RedisClient, keys: ServiceKeys, maxQueued: number | undefined): () => Promise<number> {
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
  return async () => {
    if (!maxQueued) return 0;
    const { value, lanes } = await totalQueued();
    return value >= maxQueued ? Math.max(1, Math.floor(maxQueued / (lanes + 1))) : 0;
  };
}

/**
 * Creates the intake on `redis`; records live `resultTtlS` (IDEMPOTENCY_RESULT_TTL_S). With `ack`
 * (REDIS_MIN_REPLICAS_ACK), the script and a WAIT share one round trip, and an answer is given only once the
 * replicas have the record: a new job's, or a replayed one's.
 */
export function createIntake(
  { redis, log, faults, ack, clock = Date }: {
    redis: RedisClient;
    log?: Logger;
    faults?: IntakeFaults;
    ack?: ReplicaAck;
    /** The records' clock (their expiry, their period's hash). */
    clock?: { now: Clock["epochNow"] };
  },
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
  const fullQueueShare = queueShare(redis, keys, maxQueued);
  /** What the script's submissions of one tenant (and task version) share: their entry in its heads. */
  const headOf = (tenant: string, others: number, run?: RunSubmission) =>
    JSON.stringify({
      tenant,
      cap: maxQueuedPerTenant ?? 0,
      status: markQueued(tenant, run && { ...run, priority: run.requested }),
      // The lane's id in the registry: its tenant (`laneKnownArgs`).
      lane: tenant,
      // The lane's other streams, after each submission's three keys: a cap counts the lane over all priorities.
      others,
    });
  /**
   * What a tenant's summary jobs (or runs of one task version) share in the script's call: its lane, the sets
   * that make the lane known, and its head. They are built once per tenant (and version) in use, so that a
   * request does not serialise the whole argument (what that cost: README, 'Intake against both baselines, its
   * profile, and all cores', the `enqueue` row), and kept together, so that a request looks its tenant up once
   * (each look-up in a map of 20,000 tenants cost some 0.4 µs, and the key book's cap of 10,000 lanes built one
   * per request again), within a bound of bytes, so that every tenant in use keeps its own (a cap of 10,000
   * entries rebuilt one per request at 20,000 tenants, and its eviction walked the map).
   */
  const heads = new TenantMap<Head>(
    HEADS_BYTES,
    (head) => HEAD_BYTES + (redis.isCluster ? KNOWN_BYTES : 0) + head.head.length,
  );
  // With INTAKE_MAX_QUEUED or INTAKE_MAX_QUEUED_PER_TENANT, the script counts a lane's runs over all its streams.
  const capped = maxQueuedPerTenant !== undefined || maxQueued !== undefined;
  // A large TTL still makes periods of whole seconds; 0 is refused by the configuration.
  const ttlS = Math.max(1, Math.floor(resultTtlS));
  const records = scopeRecords(keys, ttlS, clock);
  // On one server every lane is made known through the same two sets: one object for every head, not one each (a
  // head is kept per tenant in use, and each object kept is work for every full collection of V8's heap).
  const shared = redis.isCluster ? undefined : laneKnownArgs(redis, keys.registry, "", "");
  const headFor = (tenant: string, run?: RunSubmission): Head => {
    // A head per priority too: its status record names the run's priority.
    const id = run ? `${tenant}\n${run.task}\n${run.version}\n${run.requested ?? ""}` : tenant;
    let head = heads.get(id);
    if (head === undefined) {
      const lane = keys.lane(tenant);
      const known = shared ?? laneKnownArgs(redis, keys.registry, tenant, lane.stream);
      heads.set(id, head = { lane, known, head: headOf(tenant, capped ? lane.streams.length - 1 : 0, run) });
    }
    return head;
  };
  const batches = createIntakeBatches(redis, { ack, ttlS, clock }, () => maxQueued ? fullQueueShare() : 0);
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
    // the body's fingerprint in the record (its first digits, `jobFingerprint`; all of it in an old record).
    const jobId = jobIdFor(scope, canonical ?? canonicalJson(request));
    const fingerprint = jobId;
    // The answer, the same for the first request and every replay of it: a replay's is this one, rebuilt.
    const response: IntakeResponse = run
      ? { status: 202, body: { run_id: jobId, status: "queued" }, headers: { location: `${RUNS_PATH}/${jobId}` } }
      : { status: 202, body: { job_id: jobId, status: "queued" }, headers: { location: `${path}/${jobId}` } };
    const head = headFor(scope.tenant, run);
    const { lane, known } = head;
    const stream = lane.streamOf(run?.priority);
    const { stored, acked } = await batches.submit(
      // On one server every lane's known sets are the same two: one batch for all tenants. On a cluster a batch
      // is one tenant's, its keys in the lane's slot.
      redis.isCluster ? scope.tenant : "",
      head,
      // The run's stream by its priority, then (with a cap) the lane's others, whose runs the cap counts too.
      capped
        ? [records.legacyKeyIn(lane, scope), stream, lane.job(jobId), ...lane.streams.filter((s) => s !== stream)]
        : [records.legacyKeyIn(lane, scope), stream, lane.job(jobId)],
      [
        jobId,
        traceparent ?? "",
        refuse ? "1" : "0",
        run ? run.payload : payload ?? JSON.stringify(request),
        scopeDigest(scope),
        jobFingerprint(jobId),
      ],
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
    const previous = typeof stored === "string" ? JSON.parse(stored) as StoredRecord : null;
    // A reused key is refused whatever the replicas hold: nothing of this request's was written.
    if (stored === REUSED || (previous && previous.fp !== fingerprint)) throw new KeyReused();
    // Not promised until the replicas have it. The record may stay on the primary: the client's retry with
    // the same key then finds it (a replay, waited for again) or, if a failover lost it, enqueues the job
    // under the same id; either way one job id, and the commit's primary key on it keeps its effects to one.
    if (ack && acked && !acked.replicated) throw notReplicated(ack, acked.acked);
    if (stored === 0) return { response, replayed: false, jobId };
    if (stored === REPLAYED || previous === null) return { response, replayed: true, jobId };
    // A record of a release before issue 39: its stored answer (the same, as that release built it).
    const { status, body, headers } = previous;
    return { response: { status, body, headers }, replayed: true, jobId };
  };
  return {
    submit: enqueue,
    submitRun: enqueue,
    hasRecord: (scope, on = redis) => records.has(on, scope),
    forget: (scope) => records.forget(redis, scope),
  };
}

/**
 * Where a scope's record is: the key a release before issue 39 stored it under (the script reads it), and the
 * look-ups of {@linkcode Intake.hasRecord} and {@linkcode Intake.forget}.
 */
function scopeRecords(keys: ServiceKeys, ttlS: number, clock: { now(): number }) {
  // A record of a release before issue 39 is under the scope's unambiguous encoding (not hashed then, since every
  // hash is paid on the request path: README, 'Intake against both baselines, its profile, and all cores', the
  // `uuidV5` row). A record now is a field named by the scope's digest: one more SHA-1 per POST, for 32 bytes less
  // per record than the encoding as its name with a UUID as the key (about 130 with a key of 128 characters).
  const legacyKeyIn = (lane: LaneKeys, scope: Scope) => lane.idempotency(encodeScope(scope));
  const legacyKeyFor = (scope: Scope) => legacyKeyIn(keys.lane(scope.tenant), scope);
  const hashesOf = (scope: Scope) =>
    recordHashes(keys.lane(scope.tenant), ttlS, recordPeriod(ttlS, clock.now()).index).slice(0, 2);
  return {
    /** The key of `scope`'s record as a release before issue 39 stored it, in its tenant's `lane`. */
    legacyKeyIn,
    async has(redis: RedisClient, scope: Scope) {
      const field = scopeDigest(scope);
      const now = clock.now();
      for (const hash of hashesOf(scope)) {
        const record = await redis.hget(hash, field);
        if (record !== null && Number(record.slice(0, record.indexOf(":"))) * 1000 > now) return true;
      }
      return (await redis.exists(legacyKeyFor(scope))) === 1;
    },
    async forget(redis: RedisClient, scope: Scope) {
      for (const hash of hashesOf(scope)) await redis.hdel(hash, scopeDigest(scope));
      await redis.del(legacyKeyFor(scope));
    },
  };
}

/** The script's answer when the scope's record names this job (a replay), and when it names another. */
const REPLAYED = 4;
const REUSED = 5;

/** Submissions that arrive together share one script call: at most this many in one call. */
const BATCH_MAX = 64;
/** At most about this many bytes of payloads in one call (a larger submission goes alone). */
const BATCH_MAX_BYTES = 512 * 1024;
/** Calls in flight per batch; submissions that arrive meanwhile wait for one to return, and go together. */
const BATCH_IN_FLIGHT = 2;

/** What the script said of one submission, and what the replicas acknowledged of its call. */
interface Outcome {
  stored: string | number;
  acked?: AckedRun;
}

/** What the submissions of one tenant (and task version) share in a call: see the script's heads. */
interface Head {
  known: LaneKnown;
  /** Its entry in the script's heads (JSON). */
  head: string;
  lane: LaneKeys;
  /** Its lane's records hashes of the last period a call named (`recordsOf`). */
  records?: { index: number; keys: string[] };
}

interface Submission {
  head: Head;
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
  { ack, ttlS, clock }: { ack: ReplicaAck | undefined; ttlS: number; clock: { now(): number } },
  share: () => Promise<number> | number,
) {
  const queues = new Map<string, { known: LaneKnown; waiting: Submission[]; inFlight: number; scheduled: boolean }>();
  type Queue = typeof queues extends Map<string, infer Q> ? Q : never;
  const run = async (known: LaneKnown, batch: Submission[]) => {
    try {
      const heads: string[] = [];
      const index = new Map<string, number>();
      const quota = String(await share());
      const now = clock.now();
      const period = recordPeriod(ttlS, now);
      const keys = [...known.keys];
      const args = [
        ack ? "1" : "0",
        String(known.keys.length),
        "",
        String(ttlS),
        quota,
        known.wake,
        String(now),
        String(period.keepS),
      ];
      const submitted: string[] = [];
      for (const submission of batch) {
        let head = index.get(submission.head.head);
        if (head === undefined) {
          heads.push(submission.head.head);
          index.set(submission.head.head, head = heads.length);
          keys.push(...recordsOf(submission.head, ttlS, period.index));
        }
        for (const key of submission.keys) submitted.push(key);
        args.push(String(head));
        for (const arg of submission.args) args.push(arg);
      }
      for (const key of submitted) keys.push(key);
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
     * Runs one submission's part of the script (`keys`: its record of a release before issue 39, stream and
     * status record; `args`: its job id, traceparent, refusal, payload, scope digest and job fingerprint) in the
     * next call of batch `id`, whose submissions all share `head.known`.
     */
    submit(id: string, head: Head, keys: string[], args: string[]): Promise<Outcome> {
      const { promise, resolve, reject } = Promise.withResolvers<Outcome>();
      const { known } = head;
      const submission = { head, keys, args, bytes: args[3]!.length, resolve, reject };
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
