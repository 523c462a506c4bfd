import type { Sql } from "postgres";
import { listOutbox, retryFailed } from "../outbox/outbox_store.ts";
import { printRows } from "./table.ts";

const USAGE = "Usage: deno task outbox list [--failed] [--json] | retry ID [ID...] | retry --all-failed";

/**
 * `outbox list [--failed] | retry ID|--all-failed`: inspect unsent rows and
 * put failed ones back in the queue.
 * @returns the process exit code.
 */
export async function outboxCommand(sql: Sql, args: string[], out = console.log): Promise<number> {
  const [action, ...rest] = args;
  if (action === "list") {
    const rows = await listOutbox(sql, { failed: rest.includes("--failed") });
    printRows(
      rows.map((r) => ({
        id: r.id,
        dedupe_key: r.dedupe_key,
        tenant: r.tenant ?? "",
        destination: r.destination ?? "",
        state: r.state,
        attempts: r.attempts,
        next_attempt_at: r.next_attempt_at.toISOString(),
        last_error: r.last_error ?? "",
      })),
      { json: rest.includes("--json"), out, empty: rest.includes("--failed") ? "No failed rows." : "Nothing unsent." },
    );
    return 0;
  }
  if (action === "retry" && rest.length > 0) {
    const all = rest[0] === "--all-failed";
    const ids = rest.filter((a) => /^\d+$/.test(a));
    if (!all && ids.length !== rest.length) {
      console.error(`Outbox ids are numbers (got ${JSON.stringify(rest.join(" "))})`);
      return 2;
    }
    const n = await retryFailed(sql, all ? "all" : ids);
    out(`${n} failed row(s) queued for another attempt.`);
    return 0;
  }
  console.error(USAGE);
  return 2;
}
