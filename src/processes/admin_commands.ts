/** The operator commands: one-shot, each with the clients its table entry names. */
import type { RunContext } from "./run_context.ts";
import { batchesCommand } from "../cli/batches_command.ts";
import { dlqCommand } from "../cli/dlq_command.ts";
import { outboxCommand } from "../cli/outbox_command.ts";
import { providerCommand } from "../cli/provider_command.ts";
import { tasksCommand } from "../cli/tasks_command.ts";
import { tenantCommand } from "../cli/tenant_command.ts";
import { budgetRecords } from "./_budgets.ts";
import { usageCommand } from "../cli/usage_command.ts";
import { migrate, readMigrations } from "../db/migrate.ts";
import { KEY_PREFIX, serviceKeys } from "../runs/keys.ts";
import { buildFlows, providerLabel } from "./_model.ts";
import { replicaAckOf } from "./_replica_ack.ts";

/** `deno task migrate`. */
export async function runMigrate({ clients, log }: RunContext<{ sql: true }>): Promise<number> {
  const applied = await migrate({ sql: clients.sql, log }, await readMigrations());
  console.log(applied.length ? `Applied ${applied.join(", ")}` : "Database is up to date");
  return 0;
}

/** `deno task tenant ...`. */
export function runTenant({ clients, args }: RunContext<{ redis: true; sql: true }>): Promise<number> {
  return tenantCommand(clients.sql, args, console.log, { redis: clients.redis, records: budgetRecords(clients.sql) });
}

/** `deno task tasks list | show ...`. */
export function runTasks({ clients, args }: RunContext<{ sql: true }>): Promise<number> {
  return tasksCommand(clients.sql, args);
}

/** `deno task dlq ...`; a replay waits for REDIS_MIN_REPLICAS_ACK replicas, as an intake does. */
export async function runDlq({ config, clients, args }: RunContext<{ redis: true; sql: true }>): Promise<number> {
  const ack = replicaAckOf(config, clients.redis);
  try {
    return await dlqCommand({ ...clients, ack }, serviceKeys(KEY_PREFIX), args, {
      isTerminal: Deno.stdout.isTerminal(),
    });
  } finally {
    await ack?.close();
  }
}

/** `deno task outbox ...`. */
export function runOutbox({ clients, args }: RunContext<{ sql: true }>): Promise<number> {
  return outboxCommand(clients.sql, args);
}

/** `deno task provider status [--json]`. */
export function runProvider({ config, clients, args, log }: RunContext<{ redis: true }>): Promise<number> {
  return providerCommand(buildFlows(config, clients.redis, log), providerLabel(config), args);
}

/** `deno task usage [--tenant T] [--since 24h] [--json]`. */
export function runUsage({ clients, args }: RunContext<{ sql: true }>): Promise<number> {
  // Costs are read from the record (`cost_usd`, at each model's price when the call was recorded).
  return usageCommand(clients.sql, args);
}

/** `deno task batches list [--json]`. */
export function runBatches({ clients, args }: RunContext<{ sql: true }>): Promise<number> {
  return batchesCommand(clients.sql, args);
}
