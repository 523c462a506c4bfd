import type { RedisClient } from "../clients.ts";
import { listDeadLetters, replayDeadLetter } from "../queue/dead_letter.ts";
import type { JobKeys, ServiceKeys } from "../summaries/keys.ts";
import { allLanes } from "../summaries/all_lanes.ts";
import { announceLane } from "../queue/lanes.ts";
import { markQueuedOnReplay } from "../summaries/job_status.ts";
import { printRows } from "./table.ts";

const USAGE = "Usage: deno task dlq list [--json|--table] | replay ID [--tenant T] | replay --all";

/**
 * `dlq list | replay ID | replay --all`. `list` prints JSON lines (id,
 * job_id, tenant, reason, deliveries) when piped or with `--json`, and a
 * table on a terminal or with `--table`. Replay re-enqueues with the original
 * job id and removes the dead entry; replaying twice is harmless.
 * @returns the process exit code.
 */
export async function dlqCommand(
  redis: RedisClient,
  keys: ServiceKeys | JobKeys,
  args: string[],
  { out = console.log, isTerminal = false }: { out?: (line: string) => void; isTerminal?: boolean } = {},
): Promise<number> {
  const [action, target] = args;
  const lanes = await allLanes(redis, keys);
  const listAll = async () =>
    (await Promise.all(
      lanes.map(async (lane) => (await listDeadLetters(redis, lane.keys, 100_000)).map((d) => ({ ...d, lane }))),
    )).flat().sort((a, b) => a.dead_at.localeCompare(b.dead_at));
  if (action === "list") {
    const json = args.includes("--json") || (!isTerminal && !args.includes("--table"));
    const dead = await listAll();
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
    const dead = await listAll();
    const tenantAt = args.indexOf("--tenant");
    const tenant = tenantAt >= 0 ? args[tenantAt + 1] : undefined;
    const chosen = target === "--all"
      ? dead
      : dead.filter((d) => d.id === target && (tenant === undefined || d.lane.tenant === tenant));
    // Each lane's dead-letter stream numbers its own entries, so one id may name dead letters in two lanes.
    if (target !== "--all" && chosen.length > 1) {
      console.error(
        `Dead letter ${target} exists in the lanes of ${
          chosen.map((d) => d.lane.tenant ?? "(before lanes)").join(", ")
        }; ` +
          `add --tenant T to say which. Nothing done.`,
      );
      return 2;
    }
    if (chosen.length === 0) {
      out(target === "--all" ? "Nothing to replay." : `No dead letter ${target} (already replayed?). Nothing done.`);
      return 0;
    }
    let replayed = 0;
    for (const d of chosen) {
      const jobId = d.fields.job_id;
      const lane = d.lane.keys;
      const newId = await replayDeadLetter(redis, lane, d.id, jobId ? markQueuedOnReplay(lane, jobId) : undefined);
      if (newId === null) continue; // replayed concurrently by someone else
      // Back in its lane's stream: tell the workers, as an enqueue does.
      if (d.lane.tenant !== null && "lane" in keys) await announceLane(redis, keys.registry, d.lane.tenant);
      out(`Replayed ${d.id} as ${newId} (job ${jobId ?? "?"}, tenant ${d.fields.tenant ?? "?"})`);
      replayed++;
    }
    out(`${replayed} dead letter(s) replayed.`);
    return 0;
  }
  console.error(USAGE);
  return 2;
}
