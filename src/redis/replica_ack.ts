/**
 * Replicated before promised: a script and `WAIT numreplicas timeout` in one
 * round trip (a pipeline, not a MULTI), so a caller answers only once
 * REDIS_MIN_REPLICAS_ACK replicas have the script's writes.
 *
 * WAIT counts what replicas acknowledged of the writes made *on its own
 * connection* (Redis keeps each client's last write offset), and it blocks
 * that connection until it returns. So the pair runs on connections of its
 * own, one pair at a time per connection: on the process's shared connection
 * a WAIT held up by a stopped replica would hold up every other command
 * queued behind it for the whole timeout.
 *
 * On Redis Cluster the pipeline goes to the node that owns the script's keys
 * (ioredis routes a pipeline by the keys of its commands, and WAIT has none),
 * so the WAIT counts that node's replicas, on the connection that wrote.
 */
import { Cluster } from "ioredis";
import type { RedisClient } from "./client.ts";
import type { Script } from "./script.ts";

/** How long a client told "not replicated" should wait before retrying with the same key. */
const RETRY_AFTER_S = 2;

/** At most this many pairs wait for replicas at once; more wait for a connection, within the same timeout. */
const DEFAULT_CONNECTIONS = 8;

/**
 * Fewer replicas than required acknowledged a write within the timeout. The
 * write may exist on the primary (`ran`): the caller must not promise it, and
 * a retry must be able to find it (an idempotent replay), never repeat it.
 */
export class NotReplicated extends Error {
  readonly retryAfterS = RETRY_AFTER_S;
  constructor(
    message: string,
    readonly details: { acked: number; wanted: number; timeoutMs: number; ran: boolean },
    options?: ErrorOptions,
  ) {
    super(message, options);
    this.name = "NotReplicated";
  }
}

/** What a script came to on the primary, and how many replicas acknowledged it in time. */
export interface AckedRun {
  result: unknown;
  acked: number;
  /** `acked` reached the required number. */
  replicated: boolean;
}

/** Runs scripts whose writes must reach `replicas` replicas before anyone is told they happened. */
export interface ReplicaAck {
  /** REDIS_MIN_REPLICAS_ACK (at least 1). */
  readonly replicas: number;
  /** REDIS_ACK_TIMEOUT_MS: the most one `run` waits, for a connection and for the replicas together. */
  readonly timeoutMs: number;
  /**
   * Runs `script` and WAITs in the same round trip. The WAIT covers every write
   * made before it on that connection, so a script that only reads (a replay)
   * must write something (see the intake's touch) for the WAIT to cover what
   * another connection wrote.
   * @throws {NotReplicated} when no connection came free in time (nothing ran).
   */
  run(script: Script, keys: string[], args: (string | number)[]): Promise<AckedRun>;
  /** Closes the connections this opened (not `redis`). */
  close(): Promise<void>;
}

/** The error a caller throws when `run` came back short of `replicas`. */
export function notReplicated(ack: ReplicaAck, acked: number): NotReplicated {
  return new NotReplicated(
    `only ${acked} of ${ack.replicas} Redis replica(s) acknowledged the write within ${ack.timeoutMs} ms`,
    { acked, wanted: ack.replicas, timeoutMs: ack.timeoutMs, ran: true },
  );
}

/**
 * Creates the runner on duplicates of `redis` (opened on first use, at most
 * `connections`).
 */
export function createReplicaAck(
  redis: RedisClient,
  { replicas, timeoutMs, connections = DEFAULT_CONNECTIONS }: {
    replicas: number;
    timeoutMs: number;
    connections?: number;
  },
): ReplicaAck {
  if (!Number.isInteger(replicas) || replicas < 1) {
    throw new RangeError(`replicas must be at least 1 (got ${replicas})`);
  }
  // WAIT's timeout 0 means forever.
  if (!(timeoutMs >= 1)) throw new RangeError(`timeoutMs must be at least 1 (got ${timeoutMs})`);
  const opened: RedisClient[] = [];
  const idle: RedisClient[] = [];
  const queued: { give: (conn: RedisClient | null) => void }[] = [];
  let closed = false;

  const lease = (deadline: number): Promise<RedisClient | null> => {
    if (closed) return Promise.reject(new Error("The replica acknowledgement runner is closed"));
    const conn = idle.pop();
    if (conn) return Promise.resolve(conn);
    if (opened.length < connections) {
      const fresh = redis.duplicate();
      fresh.on("error", () => {}); // reconnects are retried; failures surface on commands
      opened.push(fresh);
      return Promise.resolve(fresh);
    }
    return new Promise((resolve) => {
      const entry = {
        give: (conn: RedisClient | null) => {
          clearTimeout(timer);
          resolve(conn);
        },
      };
      const timer = setTimeout(() => {
        queued.splice(queued.indexOf(entry), 1);
        resolve(null);
      }, Math.max(0, deadline - performance.now()));
      queued.push(entry);
    });
  };
  const release = (conn: RedisClient) => {
    const next = queued.shift();
    if (next) next.give(conn);
    else idle.push(conn);
  };

  // One round trip: the script, then WAIT with what is left of the timeout (at least 1 ms: 0 is forever).
  const exchange = async (
    conn: RedisClient,
    command: "evalsha" | "eval",
    body: string,
    keys: string[],
    args: (string | number)[],
    deadline: number,
  ) => {
    const waitMs = Math.max(1, Math.ceil(deadline - performance.now()));
    const replies = await conn.pipeline()[command](body, keys.length, ...keys, ...args).wait(replicas, waitMs).exec();
    if (!replies || replies.length !== 2) throw new Error("The script and WAIT pipeline was aborted");
    return replies as [[Error | null, unknown], [Error | null, unknown]];
  };

  return {
    replicas,
    timeoutMs,
    async run(script, keys, args) {
      const deadline = performance.now() + timeoutMs;
      const conn = await lease(deadline);
      if (!conn) {
        throw new NotReplicated(
          `no connection was free to wait for ${replicas} Redis replica(s) within ${timeoutMs} ms; nothing was written`,
          { acked: 0, wanted: replicas, timeoutMs, ran: false },
        );
      }
      try {
        let [[scriptError, result], [waitError, acked]] = await exchange(
          conn,
          "evalsha",
          script.sha,
          keys,
          args,
          deadline,
        );
        if (scriptError?.message.startsWith("NOSCRIPT")) {
          // Nothing ran; the WAIT's answer was about earlier writes. Once per server, and within the same deadline.
          [[scriptError, result], [waitError, acked]] = await exchange(conn, "eval", script.lua, keys, args, deadline);
        }
        if (scriptError) {
          // A slot moved: the script ran nowhere. Let the next call find the new owner.
          if (conn instanceof Cluster && /^(MOVED|ASK) /.test(scriptError.message)) conn.refreshSlotsCache();
          throw scriptError;
        }
        if (waitError) throw waitError;
        return { result, acked: Number(acked), replicated: Number(acked) >= replicas };
      } finally {
        release(conn);
      }
    },
    async close() {
      closed = true;
      for (const waiter of queued.splice(0)) waiter.give(null);
      await Promise.all(opened.map((conn) => conn.quit().catch(() => conn.disconnect())));
    },
  };
}
