import type { Sql } from "postgres";
import { listBatches } from "../batches/batch_store.ts";
import { printRows } from "./table.ts";

const USAGE = "Usage: deno task batches list [--json]";

/** How long a committed batch stays in the list. */
const RECENT_MS = 24 * 3600_000;

/**
 * `batches list [--json]`: the provider batches in flight, and those committed in the last 24 h, newest first:
 * our id, deployment, model, runs, state, the provider's batch id and status, and their times.
 * @returns the process exit code.
 */
export async function batchesCommand(
  sql: Sql,
  args: string[],
  { out = console.log, err = console.error, now = Date.now }: {
    out?: (line: string) => void;
    err?: (line: string) => void;
    now?: () => number;
  } = {},
): Promise<number> {
  const [action, ...rest] = args;
  if (action !== "list" || rest.some((a) => a !== "--json")) {
    err(USAGE);
    return 2;
  }
  const rows = await listBatches(sql, { recentMs: RECENT_MS });
  printRows(
    rows.map((b) => ({
      id: b.id,
      deployment: b.deployment,
      model: b.model,
      runs: b.runs,
      state: b.state,
      provider_batch_id: b.provider_batch_id ?? "",
      provider_status: b.provider_status ?? "",
      opened_at: b.opened_at.toISOString(),
      // In flight: since it opened; committed: how long it took.
      age_s: Math.round(((b.committed_at?.getTime() ?? now()) - b.opened_at.getTime()) / 1000),
      ended_at: b.ended_at?.toISOString() ?? "",
      committed_at: b.committed_at?.toISOString() ?? "",
    })),
    { json: rest.includes("--json"), out, empty: "No batches in flight or committed in the last 24 h." },
  );
  return 0;
}
