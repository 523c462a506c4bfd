import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import { deadLetterPages, droppedPerLane } from "../queue/inspector.ts";
import type { ServiceKeys } from "../runs/keys.ts";
import { allLanes } from "../runs/all_lanes.ts";
import { replayDeadLetters, replaySummary, type ReplayTarget } from "../runs/dead_letters.ts";
import { printRows } from "./table.ts";

const USAGE = "Usage: deno task dlq list [--json|--table] | replay ID [--tenant T] | replay --all";

/**
 * `dlq list | replay ID | replay --all`. `list` prints JSON lines (id,
 * job_id, tenant, reason, deliveries) when piped or with `--json`, and a
 * table on a terminal or with `--table`, then (on `err`) how many dead
 * letters the caps dropped. Replay re-enqueues with the original job id and
 * removes the dead entry; replaying twice is harmless, also two at once (each
 * dead letter is replayed once). It refuses, by name, a dead letter whose job
 * is already done or cancelled (a summary, an outbox row or such an outcome
 * in Postgres), that is truncated or too old, or that another replay holds.
 * With `ack` (REDIS_MIN_REPLICAS_ACK), each replay waits for the replicas;
 * the first one they do not acknowledge in time stops the replay, exit code 3.
 * @returns the process exit code.
 */
export async function dlqCommand(
  { redis, sql, ack }: { redis: RedisClient; sql: Sql; ack?: ReplicaAck },
  keys: ServiceKeys,
  args: string[],
  { out = console.log, err = console.error, isTerminal = false }: {
    out?: (line: string) => void;
    err?: (line: string) => void;
    isTerminal?: boolean;
  } = {},
): Promise<number> {
  const [action, target] = args;
  const lanes = await allLanes(redis, keys);
  if (action === "list") {
    const json = args.includes("--json") || (!isTerminal && !args.includes("--table"));
    let any = false;
    for await (const page of deadLetterPages(redis, lanes)) {
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
    for (const { lane, n } of await droppedPerLane(redis, lanes)) {
      err(
        `${n} older dead letter(s) of ${lane.tenant} were dropped by the caps ` +
          `(about 10,000 a lane, 7 days each); the worker logs each drop as dead_letters_trimmed.`,
      );
    }
    return 0;
  }
  if (action === "replay" && target) {
    const tenantAt = args.indexOf("--tenant");
    const chosen: ReplayTarget = target === "--all"
      ? { all: true }
      : { id: target, tenant: tenantAt >= 0 ? args[tenantAt + 1] : undefined };
    const report = await replayDeadLetters({ redis, sql, ack }, keys, chosen, (step) => {
      if (!step.replayed) err(step.message);
      else out(`Replayed ${step.id} as ${step.newId} (job ${step.jobId ?? "?"}, tenant ${step.tenant ?? "?"})`);
      if (step.replayed && step.unreplicated) err(step.unreplicated);
    });
    if (report.kind === "ambiguous") {
      console.error(replaySummary(report, chosen));
      return 2;
    }
    out(replaySummary(report, chosen));
    if (report.kind === "done" && (report.unreplicated || report.untried)) return 3;
    return report.kind === "done" && report.refused ? 1 : 0;
  }
  console.error(USAGE);
  return 2;
}
