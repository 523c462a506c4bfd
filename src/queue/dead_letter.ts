import type { ChainableCommander } from "ioredis";
import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import { NotReplicated, notReplicated, type ReplicaAck } from "../redis/replica_ack.ts";
import { queueDeadLetterTrim } from "./dead_letter_trim.ts";
import { fieldsToObject, type QueueNames, type StreamMessage } from "./message.ts";

/** Adds app-specific commands (e.g. marking a job failed) to the dead-letter MULTI. Keys must share the queue's hash tag. */
export type DeadLetterHook = (
  multi: ChainableCommander,
  message: StreamMessage,
  reason: string,
  names: QueueNames,
) => void;

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
export function droppedKey(names: QueueNames): string {
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
 * and XDEL on the job stream, in one MULTI/EXEC, so a message is never both
 * dead and pending, nor acknowledged and lost. The dead entry records the
 * reason, the delivery count and the original fields (tenant included),
 * each cut to `DEAD_LETTER_BOUNDS.keptFieldChars`; `dead_truncated` names the
 * fields that were cut, and such an entry is listed but never replayed.
 * The same step trims the dead-letter stream to its bounds and counts what
 * that dropped. @returns how many older dead letters were dropped.
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
  const minId = `${Date.now() - DEAD_LETTER_BOUNDS.maxAgeS * 1000}-0`;
  const multi = redis.multi()
    .xadd(names.dead, "*", ...entry)
    .xack(names.stream, names.group, message.id)
    .xdel(names.stream, message.id);
  queueDeadLetterTrim(multi, {
    dead: names.dead,
    dropped: droppedKey(names),
    maxEntries: DEAD_LETTER_BOUNDS.maxEntries,
    minId,
  });
  hook?.(multi, message, reason, names);
  const results = await multi.exec();
  if (!results) throw new Error("Dead-letter transaction was aborted");
  for (const [error] of results) if (error) throw error;
  return Number(results[3]![1]);
}

/** How many dead letters the caps have dropped from `names.dead`, ever. */
export async function droppedDeadLetters(redis: RedisClient, names: QueueNames): Promise<number> {
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
  names: QueueNames,
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
  names: QueueNames,
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
}

// REPLAY: re-enqueues a dead letter and removes it from the dead stream, atomically, and only if it is still
// there: replaying the same id twice enqueues once. An optional record changes in the same step, so a replayed
// job never reads as failed while it is queued. An entry whose fields were truncated is left alone.
// KEYS[1]  the job stream.
// KEYS[2]  the dead-letter stream.
// KEYS[3]  optional: the record to change (same hash tag).
// ARGV[1]  JSON: { dead_id, meta: [the metadata fields, dropped from the re-enqueued entry], and with KEYS[3]:
//          match: { field, value } (change the record only when the entry's field has that value),
//          set: [field, value, …] (HSET), del: [field, …] (HDEL) }.
// Returns the new entry id, false when there is no such dead letter, or {truncated fields} when it was cut.
const REPLAY = defineScript(`
local a = cjson.decode(ARGV[1])
local entries = redis.call('XRANGE', KEYS[2], a.dead_id, a.dead_id)
if #entries == 0 then return false end
local meta = {}
for _, name in ipairs(a.meta) do meta[name] = true end
local flat = entries[1][2]
for i = 1, #flat, 2 do
  if flat[i] == 'dead_truncated' and flat[i + 1] ~= '' then return {flat[i + 1]} end
end
local fields, matched = {}, false
for i = 1, #flat, 2 do
  local k = flat[i]
  if not meta[k] then
    table.insert(fields, k)
    table.insert(fields, flat[i + 1])
    if KEYS[3] and k == a.match.field and flat[i + 1] == a.match.value then matched = true end
  end
end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('XDEL', KEYS[2], a.dead_id)
if matched then
  if #a.set > 0 then redis.call('HSET', KEYS[3], unpack(a.set)) end
  if #a.del > 0 then redis.call('HDEL', KEYS[3], unpack(a.del)) end
end
return id`);

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
 * Re-enqueues a dead letter with its original fields (so the original job
 * id) and deletes it from the dead stream, atomically, applying `record` in
 * the same step. With `ack` (REDIS_MIN_REPLICAS_ACK), a WAIT follows the
 * script in the same round trip.
 * @returns the new stream entry id, or null if no such dead letter exists.
 * @throws DeadLetterTruncated if the entry kept only part of its payload.
 * @throws DeadLetterExpired if it is older than `DEAD_LETTER_BOUNDS.maxAgeS`.
 * @throws ReplayNotReplicated if it was replayed but fewer than `ack.replicas` replicas acknowledged it in time.
 * @throws NotReplicated if no connection came free to wait for them (nothing was done).
 */
export async function replayDeadLetter(
  redis: RedisClient,
  names: QueueNames,
  deadId: string,
  record?: RecordUpdate,
  { ack }: { ack?: ReplicaAck } = {},
): Promise<string | null> {
  if (isExpired(deadId)) throw new DeadLetterExpired(deadId);
  const keys = [names.stream, names.dead];
  const args: Record<string, unknown> = { dead_id: deadId, meta: META };
  if (record) {
    keys.push(record.key);
    Object.assign(args, { match: record.match, set: record.set, del: record.del });
  }
  const acked = ack ? await ack.run(REPLAY, keys, [JSON.stringify(args)]) : undefined;
  const id = acked ? acked.result : await REPLAY.run(redis, keys, [JSON.stringify(args)]);
  if (Array.isArray(id)) throw new DeadLetterTruncated(deadId, String(id[0]).split(","));
  if (typeof id !== "string") return null;
  // Only a replay that happened has anything to wait for: a missing or truncated entry wrote nothing.
  if (ack && acked && !acked.replicated) throw new ReplayNotReplicated(deadId, id, notReplicated(ack, acked.acked));
  return id;
}
