import { type Command, COMMAND_TABLE, type NetNeeds } from "./commands.ts";
import type { Config } from "./config.ts";
import { CONFIG_VARIABLES, isSentinelUrl, parseSentinelUrl, postgresHosts, SENTINEL_DEFAULT_PORT } from "./config.ts";

const DEFAULT_PORTS: Record<string, string> = {
  "redis:": "6379",
  "rediss:": "6379",
  "redis+sentinel:": String(SENTINEL_DEFAULT_PORT),
  "postgres:": "5432",
  "postgresql:": "5432",
  "http:": "80",
  "https:": "443",
};

function hostOf(url: string): string {
  const u = new URL(url);
  return `${u.hostname}:${u.port || DEFAULT_PORTS[u.protocol]}`;
}

/**
 * The `host:port` of every endpoint REDIS_URL names: its node or cluster
 * seeds, or its sentinels (one URL with several hosts, which `URL` cannot
 * parse), each followed by the nodes the launcher added.
 */
function redisHosts(redisUrl: string): string[] {
  if (!isSentinelUrl(redisUrl)) return redisUrl.split(",").map((seed) => hostOf(seed.trim()));
  return parseSentinelUrl(redisUrl).sentinels.map(({ host, port }) => `${host}:${port}`);
}

/**
 * `config` with `hostPorts` (`host:port`, an IPv6 host in brackets) added to
 * the Redis endpoints it names: as more seeds of a node or cluster URL, or
 * as more hosts of a Sentinel URL, so that {@linkcode requiredHosts} grants
 * (or, for the relay, denies) them as well.
 */
export function withRedisHosts(config: Config, hostPorts: readonly string[]): Config {
  if (hostPorts.length === 0) return config;
  const url = config.REDIS_URL.trim();
  if (!isSentinelUrl(url)) return { ...config, REDIS_URL: [url, ...hostPorts.map((h) => `redis://${h}`)].join(",") };
  const end = url.indexOf("/", "redis+sentinel://".length);
  return { ...config, REDIS_URL: `${url.slice(0, end)},${hostPorts.join(",")}${url.slice(end)}` };
}

/** The `host:port` each configured URL needs, keyed by the variable that names it. */
export function requiredHosts(config: Config, needs: NetNeeds): Record<string, string> {
  const out: Record<string, string> = {};
  if (needs.redis) {
    // Every seed of a cluster, or every sentinel, and the nodes the launcher discovered from them.
    redisHosts(config.REDIS_URL).forEach((host, i) => (out[i ? `REDIS_URL[${i}]` : "REDIS_URL"] = host));
  }
  if (needs.postgres) {
    // Every host of a multi-host URL: after a failover the client connects to another one.
    postgresHosts(config.DATABASE_URL)!.forEach((host, i) => (out[i ? `DATABASE_URL[${i}]` : "DATABASE_URL"] = host));
  }
  if (needs.listen) out["HOST/PORT"] = `${config.HOST.replace(/^\[|\]$/g, "")}:${config.PORT}`;
  if (needs.metrics && config.METRICS_PORT !== undefined) {
    out.METRICS_PORT = `${config.HOST.replace(/^\[|\]$/g, "")}:${config.METRICS_PORT}`;
  }
  if (needs.model && config.LLM_DEPLOYMENTS) {
    // Each deployment's server, and only those: OPENAI_BASE_URL names none of them then.
    for (const { name, base_url } of config.LLM_DEPLOYMENTS) out[`LLM_DEPLOYMENTS[${name}]`] = hostOf(base_url);
  } else if (needs.model && config.LLM_PROVIDER === "openai") {
    out.OPENAI_BASE_URL = hostOf(config.OPENAI_BASE_URL ?? "https://api.openai.com/v1");
  }
  if (needs.mail && config.MAIL_PROVIDER === "resend") out.RESEND_BASE_URL = hostOf(config.RESEND_BASE_URL);
  return out;
}

/**
 * The variables a process reads: the service's, and the key variables `LLM_DEPLOYMENTS` names (each process parses
 * the whole configuration, and so checks that they are set).
 */
export function envVariables(config: Config): string[] {
  const keys = (config.LLM_DEPLOYMENTS ?? []).map((deployment) => deployment.api_key_env);
  return [...new Set([...CONFIG_VARIABLES, ...keys])];
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
 * worker consumer names, the migrations folder, and for those that validate
 * tenants' schemas the right to run this Deno binary, whose child processes
 * do it: `tasks/pool_channels.ts`). `deno task <command>` launches the
 * command with these. A `binary` (`deno compile`) validates on Web Workers
 * instead: it reads their modules, and runs nothing.
 */
export function permissionFlags(
  command: Command,
  config: Config,
  migrationsDir: string,
  { binary = false }: { binary?: boolean } = {},
): string[] {
  const spec = COMMAND_TABLE[command];
  const hosts = [...new Set(Object.values(requiredHosts(config, spec.net)))];
  // A process with validation children tells them where Deno's cache is (`DENO_DIR`), and nothing else.
  const variables = spec.validation && !binary ? [...envVariables(config), "DENO_DIR"] : envVariables(config);
  const flags = [...netFlags(config, spec.net, hosts), `--allow-env=${variables.join(",")}`, "--ignore-env"];
  if (spec.hostname) flags.push("--allow-sys=hostname");
  const reads = [...(spec.migrations ? [migrationsDir] : []), ...(spec.validation && binary ? WORKER_FILES : [])];
  if (reads.length) flags.push(`--allow-read=${reads.join(",")}`);
  if (spec.validation && !binary) flags.push(`--allow-run=${Deno.execPath()}`);
  return flags;
}

/**
 * Names, at start-up, a process that validates tenants' schemas in child processes (`tasks/pool_channels.ts`)
 * but may not start them, instead of failing every validation that needs one.
 * @returns the problem, or undefined.
 */
export function missingRunPermission(command: Command, isolation: "process" | "thread"): string | undefined {
  if (!COMMAND_TABLE[command].validation || isolation !== "process") return undefined;
  const path = Deno.execPath();
  if (Deno.permissions.querySync({ name: "run", command: path }).state === "granted") return undefined;
  return `Cannot start: tenants' schemas are validated in child processes of this Deno binary (${path}), which ` +
    `the \`${command}\` task's permission set does not allow running; add --allow-run=${path} to it`;
}

const pathOf = (relative: string) => decodeURIComponent(new URL(relative, import.meta.url).pathname);

/** The schema validation Worker's module (`tasks/validator.ts` starts it); `deno compile` must include it. */
export const VALIDATION_WORKER = pathOf("./tasks/validation_worker.ts");

/**
 * What a schema validation Worker reads as it starts: Deno loads a Worker's module and every local module
 * it imports at run time, checked against the permissions of the thread that starts it (npm packages come
 * from Deno's cache and need none). tests/permissions_test.ts holds this list to the Worker's module graph.
 */
export const VALIDATION_WORKER_FILES = [
  VALIDATION_WORKER,
  pathOf("./tasks/json_schema.ts"),
  pathOf("./tasks/linear_regex.ts"),
  pathOf("./tasks/validation_cost.ts"),
  pathOf("./tasks/_validation_protocol.ts"),
  pathOf("./tasks/_pool_worker.ts"),
  pathOf("./tasks/_lru.ts"),
  // Only the meta-schemas that json_schema.ts imports are in it.
  pathOf("./tasks/metaschema"),
];

/** The task definition check Worker's module (`tasks/definition_checker.ts` starts it); `deno compile` must include it. */
export const DEFINITION_WORKER = pathOf("./tasks/definition_worker.ts");

/** What a definition check Worker reads as it starts (see {@linkcode VALIDATION_WORKER_FILES}). */
export const DEFINITION_WORKER_FILES = [
  DEFINITION_WORKER,
  pathOf("./tasks/_pool_worker.ts"),
  pathOf("./tasks/definition_check.ts"),
  pathOf("./llm/llm.ts"),
  pathOf("./llm/schema_instance.ts"),
  pathOf("./tasks/json_schema.ts"),
  pathOf("./tasks/linear_regex.ts"),
  pathOf("./tasks/metaschema"),
];

/** What the commands that start Workers (`validation` in the command table) may read: both Workers' files. */
export const WORKER_FILES = [...new Set([...VALIDATION_WORKER_FILES, ...DEFINITION_WORKER_FILES])];

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
    ...(deniesRedis(needs) ? Object.values(requiredHosts(config, { redis: true })).flatMap(everySpelling) : []),
    ...(config.WEBHOOK_ALLOW_PRIVATE ? [] : METADATA_HOSTS),
  ];
  return denied.length ? ["--allow-net", `--deny-net=${[...new Set(denied)].join(",")}`] : ["--allow-net"];
}

/** Whether a command reaches any host yet must not reach Redis (the relay): its set denies REDIS_URL's hosts. */
export function deniesRedis(needs: NetNeeds): boolean {
  return Boolean(needs.anyHost && !needs.redis);
}

/*
 * How Deno 2.9 matches `--deny-net` (tests/relay_permissions_test.ts holds it
 * to this): a rule naming a host name matches only that name, never the
 * addresses it resolves to; a rule naming an IP address or an IPv4 CIDR
 * block (`127.0.0.0/8:6379`) matches after resolution too, so it catches any
 * name or numeric alias (`2130706433`) resolving into it, and an
 * IPv4-mapped IPv6 address (`::ffff:127.0.0.1`) counts as its IPv4 one. But
 * 127.0.0.1, ::1, 0.0.0.0 and :: are four hosts to it, and it takes no IPv6
 * block. So a denied endpoint is denied by name and by every address, and
 * one on this machine by every spelling of this machine.
 */

/** `host:port` (an IPv6 host in brackets) as the bare host and the port. */
function splitHostPort(hostPort: string): { host: string; port: string } {
  const colon = hostPort.lastIndexOf(":");
  return { host: hostPort.slice(0, colon).replace(/^\[|\]$/g, ""), port: hostPort.slice(colon + 1) };
}

/**
 * The four numbers of a dotted-quad IPv4 address, or undefined for anything
 * else. A leading zero (read as octal by some parsers) makes it a name, for
 * the system's resolver to read.
 */
function ipv4Octets(text: string): number[] | undefined {
  const parts = text.split(".");
  if (parts.length !== 4 || !parts.every((part) => /^(0|[1-9]\d{0,2})$/.test(part) && Number(part) <= 255)) {
    return undefined;
  }
  return parts.map(Number);
}

/** An IPv6 address (no brackets, no zone) as the URL parser writes it, or undefined for anything else. */
function canonicalIPv6(text: string): string | undefined {
  if (!text.includes(":")) return undefined;
  try {
    return new URL(`http://[${text}]/`).hostname.slice(1, -1);
  } catch {
    return undefined;
  }
}

/** The eight 16-bit groups of an IPv6 address, or undefined. */
function ipv6Groups(text: string): number[] | undefined {
  const canonical = canonicalIPv6(text);
  if (canonical === undefined) return undefined;
  // The canonical form has no dotted quad; `::` stands for the missing zero groups.
  const [head = "", tail] = canonical.split("::");
  const groups = (half: string) => (half === "" ? [] : half.split(":").map((group) => parseInt(group, 16)));
  const missing = 8 - groups(head).length - (tail === undefined ? 0 : groups(tail).length);
  return [...groups(head), ...new Array<number>(missing).fill(0), ...(tail === undefined ? [] : groups(tail))];
}

/**
 * Whether `host` (bare) is this machine: `localhost` or `*.localhost`
 * (RFC 6761), 127.0.0.0/8, 0.0.0.0/8 (a connection to 0.0.0.0 reaches this
 * machine on Linux), `::1`, `::` (likewise), or an IPv4-mapped IPv6 address
 * in one of those blocks.
 */
function isThisMachine(host: string): boolean {
  const name = host.toLowerCase().replace(/\.$/, "");
  if (name === "localhost" || name.endsWith(".localhost")) return true;
  const v4 = ipv4Octets(name);
  if (v4) return v4[0] === 127 || v4[0] === 0;
  const v6 = ipv6Groups(name);
  if (!v6) return false;
  if (v6.slice(0, 7).every((group) => group === 0)) return v6[7] === 0 || v6[7] === 1;
  return v6.slice(0, 5).every((group) => group === 0) && v6[5] === 0xffff && [0, 127].includes(v6[6]! >> 8);
}

/**
 * The `--deny-net` entries that keep `host:port` out: the entry itself, and
 * for this machine every spelling of it on that port. A name elsewhere is
 * denied by address only once the launcher has added the addresses it
 * resolves to ({@linkcode withRedisAddresses}).
 */
function everySpelling(hostPort: string): string[] {
  const { host, port } = splitHostPort(hostPort);
  if (!isThisMachine(host)) return [hostPort];
  return [hostPort, `127.0.0.0/8:${port}`, `0.0.0.0/8:${port}`, `[::1]:${port}`, `[::]:${port}`, `localhost:${port}`];
}

/** REDIS_URL's host names (IP literals need no look-up): the launcher resolves them for the relay. */
export function redisHostNames(config: Config): string[] {
  const hosts = Object.values(requiredHosts(config, { redis: true })).map((hostPort) => splitHostPort(hostPort).host);
  return [...new Set(hosts.filter((host) => !ipv4Octets(host) && !ipv6Groups(host)))];
}

/**
 * `config` with every address that `addresses` gives for a Redis host name
 * added to REDIS_URL, on that host's port, so a permission set that denies
 * Redis denies it by address as well as by name. Anything that is not a
 * plain IPv4 or IPv6 address (an IPv6 zone, say) is left out: `--deny-net`
 * would not parse it.
 */
export function withRedisAddresses(config: Config, addresses: Readonly<Record<string, readonly string[]>>): Config {
  const extra = Object.values(requiredHosts(config, { redis: true })).flatMap((hostPort) => {
    const { host, port } = splitHostPort(hostPort);
    return (Object.hasOwn(addresses, host) ? addresses[host]! : []).flatMap((address) => {
      if (ipv4Octets(address)) return [`${address}:${port}`];
      const v6 = canonicalIPv6(address);
      return v6 === undefined ? [] : [`[${v6}]:${port}`];
    });
  });
  return withRedisHosts(config, extra);
}

/**
 * Every address each of `names` resolves to through the system's resolver
 * (getaddrinfo: the hosts file, then DNS), the one the service's own Redis
 * client connects through. A name that does not resolve maps to `[]`. Run by
 * `main.ts resolve-hosts` in a child that may look up only those names.
 */
export async function lookupAddresses(names: string[]): Promise<Record<string, string[]>> {
  // Loaded here, not at the top: the launcher itself never resolves anything.
  const { lookup } = await import("node:dns/promises");
  const entries = await Promise.all(names.map(async (name) => {
    try {
      return [name, (await lookup(name, { all: true, verbatim: true })).map((answer) => answer.address)] as const;
    } catch {
      return [name, []] as const;
    }
  }));
  return Object.fromEntries(entries);
}

/** The flags of the launcher's address probe (`main.ts resolve-hosts`): look-ups of `names`, nothing else. */
export function resolveProbeFlags(names: string[]): string[] {
  return [`--allow-net=${names.join(",")}`, "--no-prompt"];
}

/**
 * The flags of the launcher's cluster probe (`main.ts redis-nodes`): the
 * configured Redis seeds only, and the service's variables.
 */
export function redisProbeFlags(config: Config): string[] {
  const hosts = [...new Set(Object.values(requiredHosts(config, { redis: true })))];
  return [`--allow-net=${hosts.join(",")}`, `--allow-env=${CONFIG_VARIABLES.join(",")}`, "--ignore-env"];
}
