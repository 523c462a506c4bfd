import type { Sql } from "postgres";
import { type TaskHead, taskHeads, taskVersion } from "../jobs/task_store.ts";
import { printRows } from "./table.ts";

/** Tasks read from `task_heads` per query. */
const LIST_PAGE = 1_000;

const USAGE = "Usage: deno task tasks list [--tenant T] [--json] | show TENANT NAME [--version V]";

/**
 * `tasks list [--tenant T] [--json]`: every task at its latest version (tenant, name, version, how many versions,
 * model, whether it has an output schema, its bytes and all its versions' bytes, when), as a table, or JSON lines
 * with `--json`, read from columns (no definition is read). `tasks show TENANT NAME [--version V]`: one
 * version's whole definition, as JSON.
 * @returns the process exit code.
 */
export async function tasksCommand(
  sql: Sql,
  args: string[],
  out: (line: string) => void = console.log,
): Promise<number> {
  const [action, ...rest] = args;
  if (action === "list") {
    const at = rest.indexOf("--tenant");
    const tenant = at >= 0 ? rest[at + 1] : undefined;
    if (at >= 0 && !tenant) return usage();
    const heads: TaskHead[] = [];
    for (;;) {
      const last = heads.at(-1);
      const tasks = await taskHeads(sql, { tenant, limit: LIST_PAGE, after: last });
      heads.push(...tasks);
      if (tasks.length < LIST_PAGE) break;
    }
    const rows = heads.map((t) => ({
      tenant: t.tenant,
      name: t.name,
      version: t.version,
      versions: t.versions,
      model: [t.model ?? "(default)"].flat().join(", "),
      output: t.has_output_schema ? "json" : "text",
      bytes: t.bytes,
      total_bytes: t.total_bytes,
      created_at: t.created_at.toISOString(),
    }));
    printRows(rows, {
      json: rest.includes("--json"),
      out,
      empty: "No tasks yet. Define one with PUT /v1/tasks/{name}.",
    });
    return 0;
  }
  if (action === "show") {
    const [tenant, name, flag, value] = rest;
    if (!tenant || !name || (flag !== undefined && (flag !== "--version" || !/^[1-9]\d*$/.test(value ?? "")))) {
      return usage();
    }
    const task = await taskVersion(sql, tenant, name, flag ? Number(value) : undefined);
    if (!task) {
      console.error(`No task ${name}${flag ? ` version ${value}` : ""} of tenant ${JSON.stringify(tenant)}`);
      return 1;
    }
    out(
      JSON.stringify({ tenant, name, version: task.version, ...task.definition, created_at: task.created_at }, null, 2),
    );
    return 0;
  }
  return usage();
}

function usage(): number {
  console.error(USAGE);
  return 2;
}
