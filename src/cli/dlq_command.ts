import type { RedisClient } from "../clients.ts";
import { listDeadLetters, replayDeadLetter } from "../queue/dead_letter.ts";
import type { JobKeys } from "../summaries/keys.ts";
import { markQueuedOnReplay } from "../summaries/job_status.ts";
import { printRows } from "./table.ts";

const USAGE = "Usage: deno task dlq list [--json|--table] | replay ID | replay --all";

/**
 * `dlq list | replay ID | replay --all`. `list` prints JSON lines (id,
 * job_id, tenant, reason, deliveries) when piped or with `--json`, and a
 * table on a terminal or with `--table`. Replay re-enqueues with the original
 * job id and removes the dead entry; replaying twice is harmless.
 * @returns the process exit code.
 */
export async function dlqCommand(
  redis: RedisClient,
  keys: JobKeys,
  args: string[],
  { out = console.log, isTerminal = false }: { out?: (line: string) => void; isTerminal?: boolean } = {},
): Promise<number> {
  const [action, target] = args;
  if (action === "list") {
    const json = args.includes("--json") || (!isTerminal && !args.includes("--table"));
    const dead = await listDeadLetters(redis, keys, 100_000);
    printRows(
      dead.map((d) => ({
        id: d.id,
        job_id: d.fields.job_id ?? "",
        tenant: d.fields.tenant ?? "",
        reason: d.reason,
        deliveries: d.deliveries,
        dead_at: d.dead_at,
      })),
      { json, out, empty: "The dead-letter stream is empty." },
    );
    return 0;
  }
  if (action === "replay" && target) {
    const dead = await listDeadLetters(redis, keys, 100_000);
    const chosen = target === "--all" ? dead : dead.filter((d) => d.id === target);
    if (chosen.length === 0) {
      out(target === "--all" ? "Nothing to replay." : `No dead letter ${target} (already replayed?). Nothing done.`);
      return 0;
    }
    let replayed = 0;
    for (const d of chosen) {
      const jobId = d.fields.job_id;
      const newId = await replayDeadLetter(redis, keys, d.id, jobId ? markQueuedOnReplay(keys, jobId) : undefined);
      if (newId === null) continue; // replayed concurrently by someone else
      out(`Replayed ${d.id} as ${newId} (job ${jobId ?? "?"}, tenant ${d.fields.tenant ?? "?"})`);
      replayed++;
    }
    out(`${replayed} dead letter(s) replayed.`);
    return 0;
  }
  console.error(USAGE);
  return 2;
}
