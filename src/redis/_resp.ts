/**
 * A few raw RESP2 commands over one connection, for the launcher's probes
 * (`main.ts redis-nodes`), which run before any client library is loaded.
 */

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** A RESP2 reply: a simple string, integer or bulk string as text, an array, or null. */
export type Reply = string | null | Reply[];

/** One connection that sends a command and reads its reply, one at a time. */
export class RespConnection {
  #bytes = new Uint8Array();
  #chunk = new Uint8Array(64 * 1024);

  private constructor(private readonly conn: Deno.Conn) {}

  /** Connects to `host:port` (an IPv6 host without brackets), over TLS when `tls`. */
  static async open(host: string, port: number, { tls = false } = {}): Promise<RespConnection> {
    const options = { hostname: host, port };
    return new RespConnection(tls ? await Deno.connectTls(options) : await Deno.connect(options));
  }

  /**
   * Sends one command and reads its reply.
   * @throws {Error} carrying the server's error reply, or when the connection closes.
   */
  async call(...args: string[]): Promise<Reply> {
    await this.conn.write(
      encoder.encode(`*${args.length}\r\n${args.map((a) => `$${encoder.encode(a).length}\r\n${a}\r\n`).join("")}`),
    );
    return await this.#reply();
  }

  close(): void {
    this.conn.close();
  }

  async #fill(): Promise<void> {
    const n = await this.conn.read(this.#chunk);
    if (n === null) throw new Error("connection closed");
    const next = new Uint8Array(this.#bytes.length + n);
    next.set(this.#bytes);
    next.set(this.#chunk.subarray(0, n), this.#bytes.length);
    this.#bytes = next;
  }

  async #line(): Promise<string> {
    for (;;) {
      const i = this.#bytes.findIndex((b, j) => b === 13 && this.#bytes[j + 1] === 10);
      if (i >= 0) {
        const text = decoder.decode(this.#bytes.subarray(0, i));
        this.#bytes = this.#bytes.subarray(i + 2);
        return text;
      }
      await this.#fill();
    }
  }

  async #reply(): Promise<Reply> {
    const head = await this.#line();
    if (head.startsWith("-")) throw new Error(head.slice(1));
    if (head.startsWith("+") || head.startsWith(":")) return head.slice(1);
    const length = Number(head.slice(1));
    if (head.startsWith("$")) {
      if (length < 0) return null;
      while (this.#bytes.length < length + 2) await this.#fill();
      const text = decoder.decode(this.#bytes.subarray(0, length));
      this.#bytes = this.#bytes.subarray(length + 2);
      return text;
    }
    if (head.startsWith("*")) {
      if (length < 0) return null;
      const items: Reply[] = [];
      for (let i = 0; i < length; i++) items.push(await this.#reply());
      return items;
    }
    throw new Error(`unexpected reply ${head.slice(0, 40)}`);
  }
}
