import type { RedisClient } from "../clients.ts";
import { type DeadLetter, DeadLetterTruncated, pagesOfDeadLetters, replayDeadLetter } from "../queue/dead_letter.ts";
import type { JobKeys, ServiceKeys } from "../summaries/keys.ts";
import { allLanes, type LaneRef } from "../summaries/all_lanes.ts";
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
  /** Every dead letter, lane by lane, a page at a time (never the whole stream in memory). */
  async function* pages() {
    for (const lane of lanes) {
      for await (const page of pagesOfDeadLetters(redis, lane.keys)) yield page.map((d) => ({ ...d, lane }));
    }
  }
  if (action === "list") {
    const json = args.includes("--json") || (!isTerminal && !args.includes("--table"));
    let any = false;
    for await (const page of pages()) {
      any = true;
      printRows(
        page.map((d) => ({
          id: d.id,
          job_id: d.fields.job_id ?? "",
          tenant: d.fields.tenant ?? "",
          reason: d.reason,
          deliveries: d.deliveries,
          dead_at: d.dead_at,
          replayable: d.truncated.length === 0,
        })),
        { json, out },
      );
    }
    if (!any) printRows([], { json, out, empty: "The dead-letter stream is empty." });
    return 0;
  }
  if (action === "replay" && target) {
    const tenantAt = args.indexOf("--tenant");
    const tenant = tenantAt >= 0 ? args[tenantAt + 1] : undefined;
    const chosen: (DeadLetter & { lane: LaneRef })[] = [];
    for await (const page of pages()) {
      chosen.push(
        ...(target === "--all"
          ? page
          : page.filter((d) => d.id === target && (tenant === undefined || d.lane.tenant === tenant))),
      );
    }
    if (chosen.length === 0) {
      out(target === "--all" ? "Nothing to replay." : `No dead letter ${target} (already replayed?). Nothing done.`);
      return 0;
    }
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
    let replayed = 0, refused = 0;
    for (const d of chosen) {
      const jobId = d.fields.job_id;
      const lane = d.lane.keys;
      let newId: string | null;
      try {
        newId = await replayDeadLetter(redis, lane, d.id, jobId ? markQueuedOnReplay(lane, jobId) : undefined);
      } catch (error) {
        if (!(error instanceof DeadLetterTruncated)) throw error;
        console.error(`${error.message} (job ${jobId ?? "?"}, tenant ${d.fields.tenant ?? "?"})`);
        refused++;
        continue;
      }
      if (newId === null) continue; // replayed concurrently by someone else
      // Back in its lane's stream: tell the workers, as an enqueue does.
      if (d.lane.tenant !== null && "lane" in keys) await announceLane(redis, keys.registry, d.lane.tenant);
      out(`Replayed ${d.id} as ${newId} (job ${jobId ?? "?"}, tenant ${d.fields.tenant ?? "?"})`);
      replayed++;
    }
    out(`${replayed} dead letter(s) replayed.` + (refused ? ` ${refused} could not be (truncated payload).` : ""));
    return refused ? 1 : 0;
  }
  console.error(USAGE);
  return 2;
}
