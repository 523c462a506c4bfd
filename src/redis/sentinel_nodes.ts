/**
 * Asks the sentinels of REDIS_URL's Sentinel form for every node they may
 * hand out or talk through: the master, its replicas (any of which a
 * failover may promote) and the other sentinels (which the client adds to
 * its list). Run by `main.ts redis-nodes` in a child process that may reach
 * only the configured sentinels, so the launcher can grant them all.
 *
 * A running process's set is fixed when it starts (Deno widens a permission
 * at run time only through a prompt at a terminal), so a node that joins
 * later is outside it. The same questions, asked again while the process
 * runs ({@linkcode watchSentinelNodes}), and a look at each master the client
 * is handed, find such a node; {@linkcode refuseLoudly} says what to do then.
 */
import type { SentinelUrl } from "../config.ts";
import type { Logger } from "../log/logger.ts";
import { type Reply, RespConnection } from "./_resp.ts";

const ASK_TIMEOUT_MS = 2_000;
/**
 * How often a running process asks its sentinels for their nodes. Sentinels find a new replica through the
 * master's INFO, every 10 s: a replica added after start-up is named in a warning within about 40 s, well
 * before an operator would promote it on purpose.
 */
export const SENTINEL_NODES_CHECK_MS = 30_000;
/** The exit code of a process whose sentinels name a master outside its permission set: a restart grants it. */
export const EXIT_MASTER_NOT_PERMITTED = 1;

/** What a node is to the sentinels of a service. */
export type SentinelRole = "master" | "replica" | "sentinel";

/** A node the sentinels name, as `host:port` (an IPv6 host in brackets). */
export interface SentinelNode {
  address: string;
  role: SentinelRole;
}

/** `host:port`, an IPv6 host in brackets. */
function hostPort(host: string, port: string): string {
  return host.includes(":") ? `[${host}]:${port}` : `${host}:${port}`;
}

/** The `ip:port` of a flat `[field, value, ...]` reply, as SENTINEL MASTER and each entry of SENTINEL REPLICAS give. */
function addressOf(reply: Reply): string | undefined {
  if (!Array.isArray(reply)) return undefined;
  const field = (name: string) => reply[reply.indexOf(name) + 1];
  const ip = reply.includes("ip") ? field("ip") : undefined;
  const port = reply.includes("port") ? field("port") : undefined;
  return typeof ip === "string" && typeof port === "string" ? hostPort(ip, port) : undefined;
}

async function ask(host: string, port: number, service: string): Promise<SentinelNode[]> {
  const conn = await RespConnection.open(host.replace(/^\[|\]$/g, ""), port);
  const timer = setTimeout(() => conn.close(), ASK_TIMEOUT_MS);
  try {
    const master = await conn.call("SENTINEL", "MASTER", service);
    const replicas = await conn.call("SENTINEL", "REPLICAS", service);
    const sentinels = await conn.call("SENTINEL", "SENTINELS", service);
    const named = (replies: Reply[], role: SentinelRole) =>
      replies.flatMap((reply) => {
        const address = addressOf(reply);
        return address === undefined ? [] : [{ address, role }];
      });
    return [
      ...named([master], "master"),
      ...named(Array.isArray(replicas) ? replicas : [], "replica"),
      ...named(Array.isArray(sentinels) ? sentinels : [], "sentinel"),
    ];
  } finally {
    clearTimeout(timer);
    try {
      conn.close();
    } catch { /* closed by the timer */ }
  }
}

/**
 * The master, the replicas and the sentinels of `target.service`, as every
 * configured sentinel that answers reports them (one that does not answer,
 * or does not know the service, adds nothing); a node named in two roles
 * (sentinels that disagree during a failover) is listed in each.
 */
export async function sentinelTopology(target: SentinelUrl): Promise<SentinelNode[]> {
  // Each sentinel within its own time, the connect included: one on a host that drops packets would otherwise
  // hold the whole probe past the launcher's limit, and the answers of those that replied would be lost.
  const answers = await Promise.all(
    target.sentinels.map(({ host, port }) => {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const late = new Promise<SentinelNode[]>((resolve) => (timer = setTimeout(() => resolve([]), ASK_TIMEOUT_MS)));
      return Promise.race([ask(host, port, target.service).catch(() => []), late]).finally(() => clearTimeout(timer));
    }),
  );
  const seen = new Map<string, SentinelNode>();
  for (const node of answers.flat()) seen.set(`${node.role} ${node.address}`, node);
  return [...seen.values()];
}

/**
 * @returns `host:port` of the master, the replicas and the sentinels of
 * `target.service`, as every configured sentinel that answers reports them
 * (one that does not answer, or does not know the service, adds nothing).
 */
export async function sentinelNodes(target: SentinelUrl): Promise<string[]> {
  return [...new Set((await sentinelTopology(target)).map((node) => node.address))];
}

/** Whether this process's permission set lets it connect to `address` (`host:port`). */
export function netGranted(address: string): boolean {
  return Deno.permissions.querySync({ name: "net", host: address }).state === "granted";
}

/**
 * Asks `target`'s sentinels for their nodes every `everyMs` and calls
 * `onOutside` once for each node that `granted` refuses, the first time it
 * is named, so a replica added after start-up is reported before a failover
 * promotes it. A round whose sentinels do not answer reports nothing. Its
 * timer does not keep the process alive.
 * @returns `stop()`, which resolves once the round under way (if any) ends.
 */
export function watchSentinelNodes(
  target: SentinelUrl,
  options: {
    onOutside: (node: SentinelNode) => void;
    granted?: (address: string) => boolean;
    everyMs?: number;
  },
): { stop(): Promise<void> } {
  const { onOutside, granted = netGranted, everyMs = SENTINEL_NODES_CHECK_MS } = options;
  const reported = new Set<string>();
  let stopped = false;
  let timer: ReturnType<typeof setTimeout> | undefined;
  let round: Promise<void> = Promise.resolve();
  const check = async () => {
    for (const node of await sentinelTopology(target)) {
      const key = `${node.role} ${node.address}`;
      if (stopped || reported.has(key) || granted(node.address)) continue;
      reported.add(key);
      onOutside(node);
    }
  };
  const schedule = () => {
    if (stopped) return;
    timer = setTimeout(() => {
      round = check().catch(() => {}).finally(schedule);
    }, everyMs);
    Deno.unrefTimer(timer);
  };
  schedule();
  return {
    async stop() {
      stopped = true;
      clearTimeout(timer);
      await round;
    },
  };
}

/**
 * What a process does about a node outside its permission set, which only a
 * restart can grant (the launcher asks the sentinels again at every start).
 * A master: one error line naming it, then `exit`, since no command can
 * reach Redis until then and a supervisor's restart is the way back (work
 * in flight stays pending and is reclaimed, as after any crash). A replica
 * or a sentinel: one warning line, since the process still works; a replica
 * would stop it if promoted, so the line says to restart it before that.
 */
export function refuseLoudly(
  { log, exit }: { log: Logger; exit: (code: number) => void },
): (node: SentinelNode, service: string) => void {
  return (node, service) => {
    if (node.role === "master") {
      log.error("redis_master_not_permitted", {
        node: node.address,
        service,
        exit_code: EXIT_MASTER_NOT_PERMITTED,
        message: `the sentinels name ${node.address} the master of "${service}", a node outside this process's ` +
          `--allow-net (granted at start-up: the nodes the sentinels named then); exiting so that a restart, ` +
          `whose launcher asks the sentinels again, grants it`,
      });
      exit(EXIT_MASTER_NOT_PERMITTED);
      return;
    }
    log.warn("redis_node_not_permitted", {
      node: node.address,
      role: node.role,
      service,
      message: node.role === "replica"
        ? `the sentinels name ${node.address} a replica of "${service}", a node outside this process's ` +
          `--allow-net (granted at start-up: the nodes the sentinels named then); restart the process to grant ` +
          `it, or it will exit if a failover promotes that replica`
        : `the sentinels name ${node.address} a sentinel of "${service}", a node outside this process's ` +
          `--allow-net (granted at start-up: the nodes the sentinels named then); the process asks the other ` +
          `sentinels until it is restarted`,
    });
  };
}
