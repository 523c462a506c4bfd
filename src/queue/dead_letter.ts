import type { ChainableCommander } from "ioredis";
import type { RedisClient } from "../clients.ts";
import { defineScript } from "../redis/script.ts";
import { fieldsToObject, type QueueNames, type StreamMessage } from "./message.ts";

/** Adds app-specific commands (e.g. marking a job failed) to the dead-letter MULTI. Keys must share the queue's hash tag. */
export type DeadLetterHook = (
  multi: ChainableCommander,
  message: StreamMessage,
  reason: string,
  names: QueueNames,
) => void;

/** Fields the dead entry carries besides the original ones. */
const META = ["dead_reason", "dead_deliveries", "dead_at", "original_id"] as const;

/**
 * Moves a message to the dead-letter stream: XADD to the dead stream, XACK
 * and XDEL on the job stream, in one MULTI/EXEC, so a message is never both
 * dead and pending, nor acknowledged and lost. The dead entry records the
 * reason, the delivery count and the original fields (tenant included).
 */
export async function deadLetter(
  redis: RedisClient,
  names: QueueNames,
  message: StreamMessage,
  reason: string,
  hook?: DeadLetterHook,
): Promise<void> {
  const entry: string[] = [];
  for (const [k, v] of Object.entries(message.fields)) entry.push(k, v);
  const meta: Record<typeof META[number], string> = {
    dead_reason: reason.slice(0, 2000),
    dead_deliveries: String(message.deliveries),
    dead_at: new Date().toISOString(),
    original_id: message.id,
  };
  for (const k of META) entry.push(k, meta[k]);
  const multi = redis.multi()
    .xadd(names.dead, "*", ...entry)
    .xack(names.stream, names.group, message.id)
    .xdel(names.stream, message.id);
  hook?.(multi, message, reason, names);
  const results = await multi.exec();
  if (!results) throw new Error("Dead-letter transaction was aborted");
  for (const [error] of results) if (error) throw error;
}

/** A dead-lettered message as `dlq list` shows it. */
export interface DeadLetter {
  id: string;
  original_id: string;
  reason: string;
  deliveries: number;
  dead_at: string;
  /** The original fields, without the dead-letter metadata. */
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

// Re-enqueue and remove the dead entry atomically, and only if it is still
// there: replaying the same id twice enqueues once. The metadata fields are
// the ones META names (ARGV[2]); an optional record (KEYS[3]) changes in the
// same step, so a replayed job never reads as failed while it is queued.
const REPLAY = defineScript(`
local entries = redis.call('XRANGE', KEYS[2], ARGV[1], ARGV[1])
if #entries == 0 then return false end
local meta = {}
for name in string.gmatch(ARGV[2], '[^,]+') do meta[name] = true end
local flat = entries[1][2]
local fields, matched = {}, false
for i = 1, #flat, 2 do
  local k = flat[i]
  if not meta[k] then
    table.insert(fields, k)
    table.insert(fields, flat[i + 1])
    if KEYS[3] and k == ARGV[3] and flat[i + 1] == ARGV[4] then matched = true end
  end
end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('XDEL', KEYS[2], ARGV[1])
if matched then
  local n = tonumber(ARGV[5])
  if n > 0 then redis.call('HSET', KEYS[3], unpack(ARGV, 6, 5 + n)) end
  if #ARGV > 5 + n then redis.call('HDEL', KEYS[3], unpack(ARGV, 6 + n, #ARGV)) end
end
return id`);

/**
 * Re-enqueues a dead letter with its original fields (so the original job
 * id) and deletes it from the dead stream, atomically, applying `record` in
 * the same step.
 * @returns the new stream entry id, or null if no such dead letter exists.
 */
export async function replayDeadLetter(
  redis: RedisClient,
  names: QueueNames,
  deadId: string,
  record?: RecordUpdate,
): Promise<string | null> {
  const keys = [names.stream, names.dead];
  const args: (string | number)[] = [deadId, META.join(",")];
  if (record) {
    keys.push(record.key);
    args.push(record.match.field, record.match.value, record.set.length, ...record.set, ...record.del);
  }
  const id = await REPLAY.run(redis, keys, args);
  return typeof id === "string" ? id : null;
}
