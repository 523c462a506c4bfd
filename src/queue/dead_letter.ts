import type { RedisClient } from "../clients.ts";
import { NotReplicated, notReplicated, type ReplicaAck } from "../redis/replica_ack.ts";
import { runDeadLetter } from "./dead_letter_script.ts";
import { type QueueNames, type StreamMessage } from "./message.ts";
import { fieldsToObject } from "../redis/fields.ts";
import { runClaimReplay } from "./replay_claim_script.ts";
import { runReplay } from "./replay_script.ts";

/**
 * A change to an application record made by the dead-letter script, and only when that script dead-letters the
 * message: HSET `set` on `key`, then EXPIRE `ttl_s` when given. The key must share the queue's hash tag.
 */
export interface DeadLetterRecord {
  key: string;
  /** Field, value, field, value, ... */
  set: string[];
  ttl_s?: number;
}

/** Names the record a dead-lettering changes (e.g. marking the job failed), as data for the dead-letter script. */
export type DeadLetterHook = (
  message: StreamMessage,
  reason: string,
  names: QueueNames,
) => DeadLetterRecord | undefined;

/** Fields the dead entry carries besides the original ones. */
const META = ["dead_reason", "dead_deliveries", "dead_at", "original_id", "dead_truncated"] as const;

/**
 * Bounds on the dead-letter stream: at most about `maxEntries` per stream
 * and none older than `maxAgeS` (the oldest go first, trimmed as each new
 * one is added, counted and logged), and no field longer than
 * `keptFieldChars` characters. A dead letter exists for an operator to read
 * and replay; a 200,000-character document kept 10,000 times is what a
 * careless or hostile client could otherwise make Redis hold forever.
 *
 * The age bound is the job status record's lifetime (7 days): past it the
 * job is unknown to `GET`, and the service's retention no longer promises
 * the rows that say whether the job already had its effects, so an older
 * dead letter is listed as not replayable, and replay refuses it.
 */
export const DEAD_LETTER_BOUNDS = { maxEntries: 10_000, keptFieldChars: 8_192, maxAgeS: 7 * 24 * 3600 };

/** The key counting the dead letters the caps dropped from `names.dead` (same hash tag). */
export function droppedKey(names: Pick<QueueNames, "dead">): string {
  return `${names.dead}:dropped`;
}

/** A dead letter past `DEAD_LETTER_BOUNDS.maxAgeS` cannot run again. */
export class DeadLetterExpired extends Error {
  constructor(readonly deadId: string) {
    super(
      `Dead letter ${deadId} is older than ${DEAD_LETTER_BOUNDS.maxAgeS / 86_400} days; it cannot be replayed. ` +
        `The client must submit the document again.`,
    );
    this.name = "DeadLetterExpired";
  }
}

/** Whether the dead letter with stream id `id` is past the age bound at `nowMs`. */
export function isExpired(id: string, nowMs = Date.now()): boolean {
  return Number(id.split("-")[0]) < nowMs - DEAD_LETTER_BOUNDS.maxAgeS * 1000;
}

/** A dead letter whose payload was truncated cannot run again: the job's input is gone. */
export class DeadLetterTruncated extends Error {
  constructor(readonly deadId: string, readonly fields: string[]) {
    super(
      `Dead letter ${deadId} kept only the first ${DEAD_LETTER_BOUNDS.keptFieldChars} characters of ` +
        `${fields.join(", ")}; it cannot be replayed. The client must submit the document again.`,
    );
    this.name = "DeadLetterTruncated";
  }
}

/**
 * Moves a message to the dead-letter stream: XADD to the dead stream, XACK
 * and XDEL on the job stream, in one script, so a message is never both
 * dead and pending, nor acknowledged and lost. The dead entry records the
 * reason, the delivery count and the original fields (tenant included),
 * each cut to `DEAD_LETTER_BOUNDS.keptFieldChars`; `dead_truncated` names the
 * fields that were cut, and such an entry is listed but never replayed.
 * The same step changes the record `hook` names, trims the dead-letter
 * stream to its bounds and counts what that dropped.
 *
 * Safe to run twice: the script acts only while the message is pending in
 * the group or still in the stream, so a resend after a lost reply (or a
 * late second delivery) finds it gone and writes nothing.
 * @returns how many older dead letters were dropped (0 when the message was already gone: nothing written).
 */
export async function deadLetter(
  redis: RedisClient,
  names: QueueNames,
  message: StreamMessage,
  reason: string,
  hook?: DeadLetterHook,
): Promise<number> {
  const entry: string[] = [];
  const truncated: string[] = [];
  const keep = DEAD_LETTER_BOUNDS.keptFieldChars;
  for (const [k, v] of Object.entries(message.fields)) {
    if (v.length > keep) truncated.push(k);
    entry.push(k, v.length > keep ? v.slice(0, keep) : v);
  }
  const meta: Record<typeof META[number], string> = {
    dead_reason: reason.slice(0, 2000),
    dead_deliveries: String(message.deliveries),
    dead_at: new Date().toISOString(),
    original_id: message.id,
    dead_truncated: truncated.join(","),
  };
  for (const k of META) entry.push(k, meta[k]);
  const record = hook?.(message, reason, names);
  const keys: [string, string, string] = [names.stream, names.dead, droppedKey(names)];
  // A cut can split an emoji's surrogate pair. JSON would escape the lone half (`\uD83D`), which the script's cjson
  // refuses, and the message would never leave its lane: U+FFFD instead, as a plain argument's UTF-8 encoding has it.
  const wellFormed = (values: string[]) => values.map((v) => v.toWellFormed());
  const reply = await runDeadLetter(redis, record ? [...keys, record.key] : keys, {
    group: names.group,
    id: message.id,
    entry: wellFormed(entry),
    max_entries: DEAD_LETTER_BOUNDS.maxEntries,
    min_id: `${Date.now() - DEAD_LETTER_BOUNDS.maxAgeS * 1000}-0`,
    ...(record ? { set: wellFormed(record.set), ttl_s: record.ttl_s ?? 0 } : {}),
  });
  return reply ? reply[1] : 0;
}

/** How many dead letters the caps have dropped from `names.dead`, ever. */
export async function droppedDeadLetters(redis: RedisClient, names: Pick<QueueNames, "dead">): Promise<number> {
  return Number(await redis.get(droppedKey(names)) ?? 0);
}

/** A dead-lettered message as `dlq list` shows it. */
export interface DeadLetter {
  id: string;
  original_id: string;
  reason: string;
  deliveries: number;
  dead_at: string;
  /** Fields cut to `DEAD_LETTER_BOUNDS.keptFieldChars`; non-empty means it cannot be replayed. */
  truncated: string[];
  /** Older than `DEAD_LETTER_BOUNDS.maxAgeS`: it cannot be replayed. */
  expired: boolean;
  /** The original fields (some perhaps truncated), without the dead-letter metadata. */
  fields: Record<string, string>;
}

/**
 * Dead letters, oldest first, in pages of `pageSize`: a long dead-letter
 * stream is never loaded whole.
 */
export async function* pagesOfDeadLetters(
  redis: RedisClient,
  names: Pick<QueueNames, "dead">,
  pageSize = 500,
): AsyncGenerator<DeadLetter[]> {
  let after: string | undefined;
  for (;;) {
    const page = await listDeadLetters(redis, names, pageSize, after);
    if (page.length === 0) return;
    yield page;
    if (page.length < pageSize) return;
    after = page[page.length - 1]!.id;
  }
}

/** Lists dead letters, oldest first. */
export async function listDeadLetters(
  redis: RedisClient,
  names: Pick<QueueNames, "dead">,
  count = 1000,
  after?: string,
): Promise<DeadLetter[]> {
  // `after` pages: the range starts just past the last id of the previous page.
  const entries = await redis.xrange(names.dead, after ? `(${after}` : "-", "+", "COUNT", count);
  return entries.map(([id, flat]) => {
    const all = fieldsToObject(flat);
    const fields = { ...all };
    for (const k of META) delete fields[k];
    return {
      id,
      original_id: all.original_id ?? "",
      reason: all.dead_reason ?? "",
      deliveries: Number(all.dead_deliveries ?? 0),
      dead_at: all.dead_at ?? "",
      truncated: all.dead_truncated ? all.dead_truncated.split(",") : [],
      expired: isExpired(id),
      fields,
    };
  });
}

/**
 * A change to an application record made in the same script as a replay:
 * `set` and `del` on `key`, only when the dead entry's `match.field` equals
 * `match.value`. The key must share the queue's hash tag.
 */
export interface RecordUpdate {
  key: string;
  match: { field: string; value: string };
  /** Field, value, field, value, ... */
  set: string[];
  del: string[];
  /** Also remove the record's expiry (PERSIST), for a record that lives as long as its job is queued. */
  persist?: boolean;
}

/**
 * How long a replay holds a dead letter it claimed (`claimMs`; a replay that
 * stopped midway blocks others no longer), and how long the record of a
 * replay that ran is kept (`keptMs`), so that the same replay sent again
 * after a lost reply, or another replay of the same dead letter, learns
 * what happened instead of finding the dead letter merely gone.
 */
export const REPLAY_BOUNDS = { claimMs: 30_000, keptMs: 3_600_000 };

/** The replay record of dead letter `deadId` (same hash tag as `names.dead`). */
export function replayKey(names: Pick<QueueNames, "dead">, deadId: string): string {
  return `${names.dead}:replay:${deadId}`;
}

/** A replay that could not claim its dead letter, or that found it taken when it ran. */
export type ReplayMiss =
  /** Another replay ran: its new entry. */
  | { kind: "replayed_elsewhere"; newId: string }
  /** Another replay holds it (claimed, not yet run). */
  | { kind: "held" }
  /** No such dead letter: never there, trimmed, or deleted. */
  | { kind: "gone" };

/** A replay of one dead letter, named by its token: what the scripts take to tell it from any other. */
export interface ReplayClaim {
  deadId: string;
  token: string;
}

/**
 * Claims dead letter `deadId` for the replay `token` for `REPLAY_BOUNDS.claimMs`, so that another replay of it
 * stops before it changes anything. Claiming again with the same token (a resend) renews the claim.
 * @returns null when claimed, else why not.
 */
export async function claimReplay(
  redis: RedisClient,
  names: Pick<QueueNames, "dead">,
  { deadId, token }: ReplayClaim,
): Promise<ReplayMiss | null> {
  const reply = await runClaimReplay(redis, [names.dead, replayKey(names, deadId)], {
    dead_id: deadId,
    token,
    claim_ms: REPLAY_BOUNDS.claimMs,
  });
  if (reply === "ok") return null;
  if (reply[0] === "replayed") return { kind: "replayed_elsewhere", newId: reply[1] };
  return { kind: reply[0] === "claimed" ? "held" : "gone" };
}

/** Gives up the claim of replay `token` (one that decided not to replay); another replay's claim is left alone. */
export async function releaseReplay(
  redis: RedisClient,
  names: Pick<QueueNames, "dead">,
  { deadId, token }: ReplayClaim,
): Promise<void> {
  await runClaimReplay(redis, [names.dead, replayKey(names, deadId)], { dead_id: deadId, token, claim_ms: 0 });
}

/** A replay done on the primary that too few replicas acknowledged in time: it may be lost in a failover. */
export class ReplayNotReplicated extends NotReplicated {
  constructor(readonly deadId: string, readonly newId: string, cause: NotReplicated) {
    super(
      `Dead letter ${deadId} was replayed as ${newId} on the primary, but ${cause.message}: ` +
        `a failover before they catch up could undo it (it would then be listed again, and can be replayed again)`,
      cause.details,
      { cause },
    );
    this.name = "ReplayNotReplicated";
  }
}

/**
 * Replays dead letter `claim.deadId` as the replay `claim.token`: re-enqueues
 * it on `names.stream` (of a lane of several streams, the one its intake
 * writes) with its original fields (so the original job id) and deletes it
 * from the dead stream, atomically, applying `record` in the same step. It runs
 * unless another replay holds the dead letter or ran; the token need not have
 * claimed it first. Safe to run twice: the same replay sent again answers
 * its new entry and enqueues nothing more. With `ack`
 * (REDIS_MIN_REPLICAS_ACK), a WAIT follows the script in the same round trip.
 * @returns the new stream entry's id, or why nothing was done.
 * @throws DeadLetterTruncated if the entry kept only part of its payload.
 * @throws DeadLetterExpired if it is older than `DEAD_LETTER_BOUNDS.maxAgeS`.
 * @throws ReplayNotReplicated if it was replayed but fewer than `ack.replicas` replicas acknowledged it in time.
 * @throws NotReplicated if no connection came free to wait for them (nothing was done).
 */
export async function replayAs(
  redis: RedisClient,
  names: QueueNames,
  claim: ReplayClaim,
  record?: RecordUpdate,
  { ack }: { ack?: ReplicaAck } = {},
): Promise<{ kind: "replayed"; newId: string } | ReplayMiss> {
  const { deadId, token } = claim;
  if (isExpired(deadId)) throw new DeadLetterExpired(deadId);
  const keys = [names.stream, names.dead, replayKey(names, deadId)];
  if (record) keys.push(record.key);
  const { reply, acked, replicated } = await runReplay(redis, keys, {
    dead_id: deadId,
    token,
    meta: META,
    kept_ms: REPLAY_BOUNDS.keptMs,
    ...(record ? { match: record.match, set: record.set, del: record.del, persist: record.persist } : {}),
  }, ack);
  if (typeof reply !== "string") {
    if (reply[0] === "truncated") throw new DeadLetterTruncated(deadId, reply[1].split(","));
    if (reply[0] === "replayed") return { kind: "replayed_elsewhere", newId: reply[1] };
    return { kind: reply[0] === "claimed" ? "held" : "gone" };
  }
  // Only a replay that happened has anything to wait for: a miss wrote nothing.
  if (ack && !replicated) throw new ReplayNotReplicated(deadId, reply, notReplicated(ack, acked ?? 0));
  return { kind: "replayed", newId: reply };
}

/**
 * Replays a dead letter as a replay of its own (see {@linkcode replayAs}).
 * @returns the new stream entry id, or null if no such dead letter exists (or another replay has it).
 * @throws DeadLetterTruncated, DeadLetterExpired, ReplayNotReplicated, NotReplicated as `replayAs` does.
 */
export async function replayDeadLetter(
  redis: RedisClient,
  names: QueueNames,
  deadId: string,
  record?: RecordUpdate,
  { ack }: { ack?: ReplicaAck } = {},
): Promise<string | null> {
  const done = await replayAs(redis, names, { deadId, token: crypto.randomUUID() }, record, { ack });
  return done.kind === "replayed" ? done.newId : null;
}
