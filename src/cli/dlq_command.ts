import { JOB_ID } from "../summaries/schemas.ts";
import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import {
  type DeadLetter,
  DeadLetterExpired,
  DeadLetterTruncated,
  droppedDeadLetters,
  pagesOfDeadLetters,
  replayDeadLetter,
} from "../queue/dead_letter.ts";
import { failJob } from "../jobs/job_store.ts";
import { reopenFailedJob } from "../summaries/commit.ts";
import type { JobKeys, ServiceKeys } from "../summaries/keys.ts";
import { allLanes, type LaneRef } from "../summaries/all_lanes.ts";
import { announceLane } from "../queue/lanes.ts";
import { markQueuedOnReplay } from "../summaries/job_status.ts";
import { printRows } from "./table.ts";

const USAGE = "Usage: deno task dlq list [--json|--table] | replay ID [--tenant T] | replay --all";

/**
 * `dlq list | replay ID | replay --all`. `list` prints JSON lines (id,
 * job_id, tenant, reason, deliveries) when piped or with `--json`, and a
 * table on a terminal or with `--table`, then (on `err`) how many dead
 * letters the caps dropped. Replay re-enqueues with the original job id and
 * removes the dead entry; replaying twice is harmless. It refuses, by name,
 * a dead letter whose job is already done or cancelled (a summary, an outbox
 * row or such an outcome in Postgres), or that is truncated or too old.
 * @returns the process exit code.
 */
export async function dlqCommand(
  { redis, sql }: { redis: RedisClient; sql: Sql },
  keys: ServiceKeys | JobKeys,
  args: string[],
  { out = console.log, err = console.error, isTerminal = false }: {
    out?: (line: string) => void;
    err?: (line: string) => void;
    isTerminal?: boolean;
  } = {},
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
          replayable: d.truncated.length === 0 && !d.expired,
        })),
        { json, out },
      );
    }
    if (!any) printRows([], { json, out, empty: "The dead-letter stream is empty." });
    // Said apart from the rows (stderr), so a program reading the JSON lines is not handed a sentence.
    const dropped = await Promise.all(
      lanes.map(async (lane) => ({ lane, n: await droppedDeadLetters(redis, lane.keys) })),
    );
    for (const { lane, n } of dropped.filter((d) => d.n > 0)) {
      err(
        `${n} older dead letter(s) of ${lane.tenant ?? "the stream before lanes"} were dropped by the caps ` +
          `(about 10,000 a lane, 7 days each); the worker logs each drop as dead_letters_trimmed.`,
      );
    }
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
      const named = `(job ${jobId ?? "?"}, tenant ${d.fields.tenant ?? "?"})`;
      let newId: string | null;
      try {
        if (d.truncated.length > 0) throw new DeadLetterTruncated(d.id, d.truncated);
        if (d.expired) throw new DeadLetterExpired(d.id);
        // Postgres first: a job that already had its effects (or was cancelled) never runs again, and a
        // failed one is made undecided before it is queued again. A crash between the two leaves it
        // undecided and still dead-lettered: replaying again finishes the job.
        const already = jobId && JOB_ID.test(jobId) ? await reopenFailedJob(sql, jobId) : null;
        if (already) {
          err(`Dead letter ${d.id} ${named} is not replayed: its job is already ${already}. Nothing done.`);
          refused++;
          continue;
        }
        newId = await replayDeadLetter(redis, lane, d.id, jobId ? markQueuedOnReplay(lane, jobId) : undefined);
      } catch (error) {
        if (!(error instanceof DeadLetterTruncated) && !(error instanceof DeadLetterExpired)) throw error;
        err(`${error.message} ${named}`);
        refused++;
        continue;
      }
      if (newId === null) {
        // Gone meanwhile (replayed by someone else, or trimmed): put the decision back unless the job moved on.
        if (jobId && JOB_ID.test(jobId) && d.fields.tenant) await failJob(sql, jobId, d.fields.tenant, d.reason);
        continue;
      }
      // Back in its lane's stream: tell the workers, as an enqueue does.
      if (d.lane.tenant !== null && "lane" in keys) await announceLane(redis, keys.registry, d.lane.tenant);
      out(`Replayed ${d.id} as ${newId} (job ${jobId ?? "?"}, tenant ${d.fields.tenant ?? "?"})`);
      replayed++;
    }
    out(`${replayed} dead letter(s) replayed.` + (refused ? ` ${refused} could not be (see above).` : ""));
    return refused ? 1 : 0;
  }
  console.error(USAGE);
  return 2;
}
