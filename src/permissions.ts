import { type Command, COMMAND_TABLE, type NetNeeds } from "./commands.ts";
import type { Config } from "./config.ts";
import { CONFIG_VARIABLES } from "./config.ts";

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
  if (needs.redis) {
    // Every seed of a cluster, and the nodes the launcher discovered from them.
    config.REDIS_URL.split(",").forEach((seed, i) => (out[i ? `REDIS_URL[${i}]` : "REDIS_URL"] = hostOf(seed.trim())));
  }
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
export function missingNetPermissions(command: Command, config: Config): string[] {
  const problems: string[] = [];
  for (const [variable, host] of Object.entries(requiredHosts(config, COMMAND_TABLE[command].net))) {
    if (Deno.permissions.querySync({ name: "net", host }).state !== "granted") {
      problems.push(
        `Cannot start: ${variable} needs network access to ${host}, which the \`${command}\` task's permission set ` +
          `does not allow; add it to that task's --allow-net list in deno.json`,
      );
    }
  }
  return problems;
}

/**
 * The exact permission flags of a command under a configuration: network
 * access to the hosts its configured URLs name and nothing else, the
 * service's variables, and the few extras a command needs (the hostname for
 * worker consumer names, the migrations folder). `deno task <command>`
 * launches the command with these.
 */
export function permissionFlags(command: Command, config: Config, migrationsDir: string): string[] {
  const spec = COMMAND_TABLE[command];
  const hosts = [...new Set(Object.values(requiredHosts(config, spec.net)))];
  const flags = [...netFlags(config, spec.net, hosts), `--allow-env=${CONFIG_VARIABLES.join(",")}`, "--ignore-env"];
  if (spec.hostname) flags.push("--allow-sys=hostname");
  if (spec.migrations) flags.push(`--allow-read=${migrationsDir}`);
  return flags;
}

/** Cloud metadata endpoints (AWS, GCP, Azure, and AWS's IPv6 one): never a webhook receiver. */
const METADATA_HOSTS = ["169.254.169.254", "[fd00:ec2::254]", "metadata.google.internal"];

/**
 * `--allow-net` for `hosts`; or, for a command that must reach any host
 * (webhook receivers), every host but Redis (unless it uses Redis) and the
 * metadata endpoints (unless WEBHOOK_ALLOW_PRIVATE), which `--deny-net`
 * keeps out even if the code's own address check were bypassed.
 */
function netFlags(config: Config, needs: NetNeeds, hosts: string[]): string[] {
  if (!needs.anyHost) return [`--allow-net=${hosts.join(",")}`];
  const denied = [
    ...(needs.redis ? [] : Object.values(requiredHosts(config, { redis: true }))),
    ...(config.WEBHOOK_ALLOW_PRIVATE ? [] : METADATA_HOSTS),
  ];
  return denied.length ? ["--allow-net", `--deny-net=${[...new Set(denied)].join(",")}`] : ["--allow-net"];
}

/**
 * The flags of the launcher's cluster probe (`main.ts redis-nodes`): the
 * configured Redis seeds only, and the service's variables.
 */
export function redisProbeFlags(config: Config): string[] {
  const hosts = [...new Set(Object.values(requiredHosts(config, { redis: true })))];
  return [`--allow-net=${hosts.join(",")}`, `--allow-env=${CONFIG_VARIABLES.join(",")}`, "--ignore-env"];
}
