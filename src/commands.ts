/**
 * Every command the service runs, declared once: the outside hosts it talks
 * to, the clients it needs, its extra permissions, whether it ships as a
 * binary, and the code that runs it. The permission flags, the launcher, the
 * start-up check and `deno task compile` are all derived from this table.
 *
 * The code is loaded lazily, so the launcher (which reads only this table
 * and the configuration) loads none of the service's dependencies.
 */
import type { ClientNeeds, RunContext } from "./processes/run_context.ts";

/** Which outside hosts a command talks to, each from a configured URL. */
export interface NetNeeds {
  redis?: boolean;
  postgres?: boolean;
  model?: boolean;
  mail?: boolean;
  /** Listens on HOST:PORT. */
  listen?: boolean;
  /** Serves /metrics on METRICS_PORT when it is set. */
  metrics?: boolean;
  /**
   * Reaches hosts no configuration names: the tenants' webhook receivers.
   * The code refuses private addresses (see `webhooks/addresses.ts`); the
   * permission set still denies Redis and the cloud metadata address.
   */
  anyHost?: boolean;
}

/** One command of the table. */
export interface CommandSpec<N extends ClientNeeds = ClientNeeds> {
  net: NetNeeds;
  clients: N;
  /** The API's Redis client fails fast (a 5xx lets the client retry) instead of waiting out a Redis restart. */
  failFast?: boolean;
  /** Reads the host name (the worker's consumer name). */
  hostname?: boolean;
  /** Reads the migrations folder. */
  migrations?: boolean;
  /** Validates against tenants' schemas on Web Workers (`tasks/validator.ts`): reads those Workers' modules. */
  validation?: boolean;
  /** Built as `dist/oncely-<command>` by `deno task compile`. */
  binary?: boolean;
  /** @returns the process exit code. */
  run(): Promise<(ctx: RunContext<N>) => Promise<number>>;
}

const command = <N extends ClientNeeds>(spec: CommandSpec<N>): CommandSpec<N> => spec;

/** The table. */
export const COMMAND_TABLE = {
  api: command({
    net: { redis: true, postgres: true, listen: true },
    clients: { redis: true, sql: true },
    failFast: true,
    validation: true,
    binary: true,
    run: async () => (await import("./processes/api_process.ts")).runApi,
  }),
  worker: command({
    net: { redis: true, postgres: true, model: true, metrics: true },
    clients: { redis: true, sql: true },
    hostname: true,
    validation: true,
    binary: true,
    run: async () => (await import("./processes/worker_process.ts")).runWorker,
  }),
  relay: command({
    net: { postgres: true, mail: true, metrics: true, anyHost: true },
    clients: { sql: true },
    binary: true,
    run: async () => (await import("./processes/relay_process.ts")).runRelay,
  }),
  dev: command({
    net: { redis: true, postgres: true, listen: true, model: true, mail: true, anyHost: true },
    clients: { redis: true, sql: true },
    hostname: true,
    migrations: true,
    validation: true,
    run: async () => (await import("./processes/dev_process.ts")).runDev,
  }),
  migrate: command({
    net: { postgres: true },
    clients: { sql: true },
    migrations: true,
    run: async () => (await import("./processes/admin_commands.ts")).runMigrate,
  }),
  tenant: command({
    net: { redis: true, postgres: true },
    clients: { redis: true, sql: true },
    run: async () => (await import("./processes/admin_commands.ts")).runTenant,
  }),
  dlq: command({
    net: { redis: true, postgres: true },
    clients: { redis: true, sql: true },
    run: async () => (await import("./processes/admin_commands.ts")).runDlq,
  }),
  outbox: command({
    net: { postgres: true },
    clients: { sql: true },
    run: async () => (await import("./processes/admin_commands.ts")).runOutbox,
  }),
  provider: command({
    net: { redis: true },
    clients: { redis: true },
    run: async () => (await import("./processes/admin_commands.ts")).runProvider,
  }),
  tasks: command({
    net: { postgres: true },
    clients: { sql: true },
    run: async () => (await import("./processes/admin_commands.ts")).runTasks,
  }),
  usage: command({
    net: { postgres: true },
    clients: { sql: true },
    run: async () => (await import("./processes/admin_commands.ts")).runUsage,
  }),
  batches: command({
    net: { postgres: true },
    clients: { sql: true },
    run: async () => (await import("./processes/admin_commands.ts")).runBatches,
  }),
};

/** A command's name. */
export type Command = keyof typeof COMMAND_TABLE;

/** Every command, in table order. */
export const COMMANDS = Object.keys(COMMAND_TABLE) as Command[];

/** Whether `name` is a command of the table. */
export function isCommand(name: string | undefined): name is Command {
  return name !== undefined && Object.hasOwn(COMMAND_TABLE, name);
}
