/**
 * Asks the sentinels of REDIS_URL's Sentinel form for every node they may
 * hand out or talk through: the master, its replicas (any of which a
 * failover may promote) and the other sentinels (which the client adds to
 * its list). Run by `main.ts redis-nodes` in a child process that may reach
 * only the configured sentinels, so the launcher can grant them all.
 */
import type { SentinelUrl } from "../config.ts";
import { type Reply, RespConnection } from "./_resp.ts";

const ASK_TIMEOUT_MS = 2_000;

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

async function ask(host: string, port: number, service: string): Promise<string[]> {
  const conn = await RespConnection.open(host.replace(/^\[|\]$/g, ""), port);
  const timer = setTimeout(() => conn.close(), ASK_TIMEOUT_MS);
  try {
    const master = addressOf(await conn.call("SENTINEL", "MASTER", service));
    const list = async (what: string) => {
      const reply = await conn.call("SENTINEL", what, service);
      return Array.isArray(reply) ? reply.map(addressOf) : [];
    };
    return [master, ...await list("REPLICAS"), ...await list("SENTINELS")].filter((a): a is string => a !== undefined);
  } finally {
    clearTimeout(timer);
    try {
      conn.close();
    } catch { /* closed by the timer */ }
  }
}

/**
 * @returns `host:port` of the master, the replicas and the sentinels of
 * `target.service`, as every configured sentinel that answers reports them
 * (one that does not answer, or does not know the service, adds nothing).
 */
export async function sentinelNodes(target: SentinelUrl): Promise<string[]> {
  // Each sentinel within its own time, the connect included: one on a host that drops packets would otherwise
  // hold the whole probe past the launcher's limit, and the answers of those that replied would be lost.
  const answers = await Promise.all(
    target.sentinels.map(({ host, port }) => {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const late = new Promise<string[]>((resolve) => (timer = setTimeout(() => resolve([]), ASK_TIMEOUT_MS)));
      return Promise.race([ask(host, port, target.service).catch(() => []), late]).finally(() => clearTimeout(timer));
    }),
  );
  return [...new Set(answers.flat())];
}
