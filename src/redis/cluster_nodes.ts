/**
 * Asks a Redis node which nodes its cluster has, with a few raw RESP
 * commands (no client library), so the launcher can add every node to a
 * process's permission set. Run by `main.ts redis-nodes` in a child process
 * that may reach only the configured seeds.
 */
import { RespConnection } from "./_resp.ts";

/**
 * @returns `host:port` of every node of the cluster that `url` belongs to,
 * or an empty list when it is a standalone server.
 */
export async function clusterNodes(url: string): Promise<string[]> {
  const u = new URL(url);
  const conn = await RespConnection.open(u.hostname.replace(/^\[|\]$/g, ""), Number(u.port || 6379), {
    tls: u.protocol === "rediss:",
  });
  try {
    if (u.password) {
      const password = decodeURIComponent(u.password);
      await (u.username ? conn.call("AUTH", decodeURIComponent(u.username), password) : conn.call("AUTH", password));
    }
    if (!/cluster_enabled:1/.test(String(await conn.call("INFO", "cluster")))) return [];
    const nodes = String(await conn.call("CLUSTER", "NODES")).split("\n").filter(Boolean).map((line) => {
      // <id> <ip:port@cport[,hostname]> <flags> ...
      const address = line.split(" ")[1]!.split("@")[0]!;
      const host = address.slice(0, address.lastIndexOf(":")) || u.hostname;
      return `${host}:${address.slice(address.lastIndexOf(":") + 1)}`;
    });
    return [...new Set(nodes)];
  } finally {
    conn.close();
  }
}
