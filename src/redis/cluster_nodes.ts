/**
 * Asks a Redis node which nodes its cluster has, with a few raw RESP
 * commands (no client library), so the launcher can add every node to a
 * process's permission set. Run by `main.ts redis-nodes` in a child process
 * that may reach only the configured seeds.
 */

const encoder = new TextEncoder();
const decoder = new TextDecoder();

function command(...args: string[]): Uint8Array {
  return encoder.encode(
    `*${args.length}\r\n${args.map((a) => `$${encoder.encode(a).length}\r\n${a}\r\n`).join("")}`,
  );
}

/** Reads one RESP reply (simple string, error, integer or bulk string) from `conn`. */
async function reply(conn: Deno.Conn, buffered: { bytes: Uint8Array }): Promise<string> {
  const chunk = new Uint8Array(64 * 1024);
  const fill = async () => {
    const n = await conn.read(chunk);
    if (n === null) throw new Error("connection closed");
    const next = new Uint8Array(buffered.bytes.length + n);
    next.set(buffered.bytes);
    next.set(chunk.subarray(0, n), buffered.bytes.length);
    buffered.bytes = next;
  };
  const line = async () => {
    for (;;) {
      const i = buffered.bytes.findIndex((b, j) => b === 13 && buffered.bytes[j + 1] === 10);
      if (i >= 0) {
        const text = decoder.decode(buffered.bytes.subarray(0, i));
        buffered.bytes = buffered.bytes.subarray(i + 2);
        return text;
      }
      await fill();
    }
  };
  const head = await line();
  if (head.startsWith("-")) throw new Error(head.slice(1));
  if (head.startsWith("+") || head.startsWith(":")) return head.slice(1);
  if (head.startsWith("$")) {
    const length = Number(head.slice(1));
    if (length < 0) return "";
    while (buffered.bytes.length < length + 2) await fill();
    const text = decoder.decode(buffered.bytes.subarray(0, length));
    buffered.bytes = buffered.bytes.subarray(length + 2);
    return text;
  }
  throw new Error(`unexpected reply ${head.slice(0, 40)}`);
}

/**
 * @returns `host:port` of every node of the cluster that `url` belongs to,
 * or an empty list when it is a standalone server.
 */
export async function clusterNodes(url: string): Promise<string[]> {
  const u = new URL(url);
  const options = { hostname: u.hostname, port: Number(u.port || 6379) };
  const conn = u.protocol === "rediss:" ? await Deno.connectTls(options) : await Deno.connect(options);
  const buffered = { bytes: new Uint8Array() };
  try {
    if (u.password) {
      const auth = u.username
        ? command("AUTH", decodeURIComponent(u.username), decodeURIComponent(u.password))
        : command("AUTH", decodeURIComponent(u.password));
      await conn.write(auth);
      await reply(conn, buffered);
    }
    await conn.write(command("INFO", "cluster"));
    if (!/cluster_enabled:1/.test(await reply(conn, buffered))) return [];
    await conn.write(command("CLUSTER", "NODES"));
    const nodes = (await reply(conn, buffered)).split("\n").filter(Boolean).map((line) => {
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
