import type { Config } from "./config.ts";
import { CONFIG_VARIABLES } from "./config.ts";

/** Which outside hosts a process talks to. */
export interface NetNeeds {
  redis?: boolean;
  postgres?: boolean;
  model?: boolean;
  mail?: boolean;
  listen?: boolean;
  /** Serves /metrics on METRICS_PORT when it is set. */
  metrics?: boolean;
}

const DEFAULT_PORTS: Record<string, string> = {
  "redis:": "6379",
  "rediss:": "6379",
  "postgres:": "5432",
  "postgresql:": "5432",
  "http:": "80",
  "https:": "443",
};

function hostOf(url: string): string {
  const u = new URL(url);
  return `${u.hostname}:${u.port || DEFAULT_PORTS[u.protocol]}`;
}

/** The `host:port` each configured URL needs, keyed by the variable that names it. */
export function requiredHosts(config: Config, needs: NetNeeds): Record<string, string> {
  const out: Record<string, string> = {};
  if (needs.redis) out.REDIS_URL = hostOf(config.REDIS_URL);
  if (needs.postgres) out.DATABASE_URL = hostOf(config.DATABASE_URL);
  if (needs.listen) out["HOST/PORT"] = `${config.HOST.replace(/^\[|\]$/g, "")}:${config.PORT}`;
  if (needs.metrics && config.METRICS_PORT !== undefined) {
    out.METRICS_PORT = `${config.HOST.replace(/^\[|\]$/g, "")}:${config.METRICS_PORT}`;
  }
  if (needs.model && config.LLM_PROVIDER === "openai") {
    out.OPENAI_BASE_URL = hostOf(config.OPENAI_BASE_URL ?? "https://api.openai.com/v1");
  }
  if (needs.mail && config.MAIL_PROVIDER === "resend") out.RESEND_BASE_URL = hostOf(config.RESEND_BASE_URL);
  return out;
}

/**
 * Names, at start-up, a configured host this process's permission set does
 * not allow, instead of failing on the first request (which would, for
 * example, dead-letter jobs over a deployment mistake).
 * @returns one line per missing permission; empty when all are granted.
 */
export function missingNetPermissions(command: string, config: Config, needs: NetNeeds): string[] {
  const problems: string[] = [];
  for (const [variable, host] of Object.entries(requiredHosts(config, needs))) {
    if (Deno.permissions.querySync({ name: "net", host }).state !== "granted") {
      problems.push(
        `Cannot start: ${variable} needs network access to ${host}, which the \`${command}\` task's permission set ` +
          `does not allow; add it to that task's --allow-net list in deno.json`,
      );
    }
  }
  return problems;
}

/** The processes and commands main.ts runs. */
export const COMMANDS = ["api", "worker", "relay", "migrate", "dev", "tenant", "dlq", "outbox", "provider"] as const;
export type Command = typeof COMMANDS[number];

/** What each command talks to. */
export const NEEDS: Record<Command, NetNeeds> = {
  api: { redis: true, postgres: true, listen: true },
  worker: { redis: true, postgres: true, model: true, metrics: true },
  relay: { postgres: true, mail: true, metrics: true },
  dev: { redis: true, postgres: true, listen: true, model: true, mail: true },
  migrate: { postgres: true },
  tenant: { postgres: true },
  dlq: { redis: true },
  outbox: { postgres: true },
  provider: { redis: true },
};

/**
 * The exact permission flags of a command under a configuration: network
 * access to the hosts its configured URLs name and nothing else, the
 * service's variables, and the few extras a command needs (the hostname for
 * worker consumer names, the migrations folder). `deno task <command>`
 * launches the command with these.
 */
export function permissionFlags(command: Command, config: Config, migrationsDir: string): string[] {
  const hosts = [...new Set(Object.values(requiredHosts(config, NEEDS[command])))];
  const flags = [`--allow-net=${hosts.join(",")}`, `--allow-env=${CONFIG_VARIABLES.join(",")}`, "--ignore-env"];
  if (command === "worker" || command === "dev") flags.push("--allow-sys=hostname");
  if (command === "migrate" || command === "dev") flags.push(`--allow-read=${migrationsDir}`);
  return flags;
}
