import { Cluster, Redis, type RedisOptions } from "ioredis";
import postgres, { type Sql } from "postgres";
import { withTimeout } from "./async/timeout.ts";
import { isSentinelUrl, parseSentinelUrl, postgresHosts, redactUrl, type SentinelUrl } from "./config.ts";
import type { RedisClient } from "./redis/client.ts";
import { netGranted, type SentinelNode, sentinelTopology, watchSentinelNodes } from "./redis/sentinel_nodes.ts";

export type { RedisClient } from "./redis/client.ts";

/** A dependency that did not answer at start-up; the message says how to start it. */
export class DependencyDown extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "DependencyDown";
  }
}

const STARTUP_TIMEOUT_MS = 3_000;

/** The seed nodes of REDIS_URL: one URL, or a comma-separated list. */
export function redisSeeds(url: string): URL[] {
  return url.split(",").map((part) => new URL(part.trim()));
}

function redisOptions(seed: URL, options: { name?: string; failFast?: boolean }): RedisOptions {
  return {
    ...commonOptions(options),
    username: seed.username ? decodeURIComponent(seed.username) : undefined,
    password: seed.password ? decodeURIComponent(seed.password) : undefined,
    tls: seed.protocol === "rediss:" ? {} : undefined,
  };
}

/** What every client shares, whatever names the server: one node, a cluster's nodes, or sentinels. */
function commonOptions(options: { name?: string; failFast?: boolean }): RedisOptions {
  return {
    connectionName: options.name,
    // Background loops keep retrying commands across a Redis restart; a
    // request handler fails fast instead (a 5xx is never stored, so the
    // client retries), rather than hanging until Redis is back.
    maxRetriesPerRequest: options.failFast ? 2 : null,
    // Commands issued in the same tick share one write, which under
    // concurrent requests raises ingest's rate (see README, "Redis Cluster").
    enableAutoPipelining: true,
    retryStrategy: (times) => Math.min(50 * 2 ** times, 2_000),
  };
}

/**
 * Connects to Redis and checks that it answers. Cluster mode is detected,
 * not configured: a comma-separated list of seeds, or a node whose
 * `INFO cluster` says `cluster_enabled:1`, gets ioredis's cluster client.
 * A `redis+sentinel://` URL gets a client that asks its sentinels for the
 * master and follows failovers ({@linkcode connectSentinel}).
 * @throws {DependencyDown} naming the URL and how to start Redis.
 */
export async function connectRedis(
  url: string,
  options: { name?: string; failFast?: boolean } & SentinelNodeOptions = {},
): Promise<RedisClient> {
  if (isSentinelUrl(url)) return await connectSentinel(parseSentinelUrl(url), options);
  const seeds = redisSeeds(url);
  const first = seeds[0]!;
  const probe = new Redis(first.toString(), { ...redisOptions(first, options), lazyConnect: true });
  probe.on("error", () => {}); // reconnects are retried; failures surface on commands
  let cluster = seeds.length > 1;
  try {
    await withTimeout(probe.connect().then(() => probe.ping()), STARTUP_TIMEOUT_MS, "Redis ping");
    if (!cluster) cluster = /cluster_enabled:1/.test(await probe.info("cluster"));
  } catch (cause) {
    probe.disconnect();
    throw new DependencyDown(
      `Cannot start: Redis at ${redactUrl(first.toString())} (REDIS_URL) does not answer: ${
        (cause as Error).message
      }. ` +
        `Start it with \`docker compose up -d redis\` or \`redis-server --daemonize yes\`.`,
      { cause },
    );
  }
  if (!cluster) return probe;
  probe.disconnect();
  if (seeds.some((seed) => seed.pathname.length > 1 && seed.pathname !== "/0")) {
    throw new DependencyDown(
      `Cannot start: REDIS_URL names a database (${first.pathname}), which a Redis Cluster does not have`,
    );
  }
  const nodeOptions = { ...redisOptions(first, options), enableAutoPipelining: false };
  const client = new Cluster(seeds.map((seed) => ({ host: seed.hostname, port: Number(seed.port || 6379) })), {
    redisOptions: nodeOptions,
    // Off on a cluster: ioredis routes an auto-pipelined EVALSHA by its first argument (the script's SHA),
    // not its key, and then refuses a pipeline that mixes slots (redis/ioredis#2109).
    enableAutoPipelining: false,
    // Commands wait for the cluster to be ready, and retry MOVED/ASK and a failed-over master.
    maxRedirections: 16,
    clusterRetryStrategy: (times) => Math.min(100 * 2 ** times, 2_000),
    lazyConnect: true,
  });
  client.on("error", () => {});
  try {
    await withTimeout(client.connect().then(() => client.ping()), STARTUP_TIMEOUT_MS, "Redis Cluster ping");
    return client;
  } catch (cause) {
    client.disconnect();
    throw new DependencyDown(
      `Cannot start: the Redis Cluster at ${seeds.map((s) => redactUrl(s.toString())).join(",")} (REDIS_URL) ` +
        `does not answer: ${(cause as Error).message}.`,
      { cause },
    );
  }
}

/**
 * A Postgres URL with several hosts, those that answer first. postgres.js tries the hosts in order for every new
 * connection and moves to the next after a socket error, but not after CONNECT_TIMEOUT (3.4.9): a first host that
 * is powered off or hung (no refusal, no answer) would fail start-up, and the first attempt of every new pool
 * connection. So at start-up each host is asked once, all at once, within the connect timeout, and the ones that
 * answer go first, in their order; the rest follow (one may be back later). Any server that answers counts: which
 * one takes writes is still decided by `target_session_attrs`. A URL with one host is returned as it is.
 */
async function answeringFirst(url: string): Promise<string> {
  const hosts = postgresHosts(url);
  const parts = /^(postgres(?:ql)?:\/\/(?:[^@/?#]*@)?)([^/?#]*)(.*)$/is.exec(url);
  if (!hosts || hosts.length < 2 || !parts) return url;
  const [, head, , tail] = parts as unknown as [string, string, string, string];
  // Asked for liveness only: a standby answers too (the role check is the pool's, per connection).
  const probeTail = tail.replace(/([?&])target_session_attrs=[^&#]*&?/i, "$1").replace(/[?&](#|$)/, "$1");
  const answers = await Promise.all(hosts.map(async (host) => {
    const probe = postgres(`${head}${host}${probeTail}`, {
      max: 1,
      connect_timeout: PG_CONNECT_TIMEOUT_S,
      onnotice: () => {},
      connection: { application_name: "oncely" },
    });
    try {
      await withTimeout(probe`SELECT 1`, PG_CONNECT_TIMEOUT_S * 1000 + 500, "Postgres probe");
      return true;
    } catch {
      return false;
    } finally {
      await probe.end({ timeout: 0 }).catch(() => {});
    }
  }));
  if (answers.every(Boolean) || !answers.some(Boolean)) return url;
  const ordered = [...hosts.filter((_, i) => answers[i]), ...hosts.filter((_, i) => !answers[i])];
  return `${head}${ordered.join(",")}${tail}`;
}

/** A connection attempt to one host that takes longer fails; with several hosts the next attempt tries the next. */
const PG_CONNECT_TIMEOUT_S = 3;
/**
 * Idle pool connections close after this: after a failover none lingers on a host that went away without
 * closing its sockets, and the next query connects to whichever host is the primary then.
 */
const PG_IDLE_TIMEOUT_S = 60;

/**
 * ioredis's client, as a Sentinel client: its failover detector keeps a
 * subscription to `+switch-master` open on the sentinels, which ioredis
 * closes on `disconnect()` but not on `quit()`; ending the client here ends
 * them too, and a `duplicate()` (the lanes' subscriber) is one of these.
 */
class SentinelClient extends Redis {
  constructor(options: RedisOptions) {
    super(options);
    this.on("end", () => this.disconnect());
  }

  override duplicate(override?: Partial<RedisOptions>): Redis {
    return new SentinelClient({ ...this.options, ...override });
  }
}

/** How REDIS_URL names a Sentinel service in messages: the sentinels and the service, never the password. */
function describeSentinels(target: SentinelUrl): string {
  return `redis+sentinel://${target.sentinels.map(({ host, port }) => `${host}:${port}`).join(",")}/${target.service}`;
}

/** What a Sentinel client does about the nodes its sentinels name outside this process's permission set. */
export interface SentinelNodeOptions {
  /**
   * Called once per node and role: a master the client was refused a
   * connection to, and each replica or sentinel that a check every
   * `SENTINEL_NODES_CHECK_MS` finds (`refuseLoudly` in
   * `redis/sentinel_nodes.ts` is the service's). Unset: no check.
   */
  onNodeRefused?: (node: SentinelNode, service: string) => void;
}

/**
 * Connects to the master that `target`'s sentinels name, and checks that it
 * answers. The client follows failovers: a lost connection is reopened to
 * whichever node the sentinels name by then (while they still name the dead
 * master, the attempt fails and is retried with the same backoff as a
 * single node's); a `+switch-master` from any sentinel, or a `READONLY`
 * reply from a demoted master, drops the connection so it is reopened to
 * the new one. With `onNodeRefused`, a node outside the process's
 * permission set is reported ({@linkcode SentinelNodeOptions}).
 * @throws {DependencyDown} when no sentinel names a master that answers.
 */
export async function connectSentinel(
  target: SentinelUrl,
  options: { name?: string; failFast?: boolean } & SentinelNodeOptions = {},
): Promise<RedisClient> {
  let lastSentinelError: Error | undefined;
  const client = new SentinelClient({
    ...commonOptions(options),
    sentinels: target.sentinels.map(({ host, port }) => ({ host: host.replace(/^\[|\]$/g, ""), port })),
    name: target.service,
    db: target.db,
    username: target.username,
    password: target.password,
    // Must always return a number: `null` would end the client for good the first time every sentinel is down.
    sentinelRetryStrategy: (times) => Math.min(50 * 2 ** times, 2_000),
    failoverDetector: true,
    // A write the demoted master refused was not applied, so the caller may retry it; it is not resent here,
    // since a transaction's queued commands would be resent one by one.
    reconnectOnError: (error) => error.message.startsWith("READONLY"),
    lazyConnect: true,
  });
  client.on("error", () => {}); // reconnects are retried; failures surface on commands
  client.on("sentinelError", (error: Error) => (lastSentinelError = error));
  const watch = watchRefusedNodes(client, target, options);
  try {
    await withTimeout(client.connect().then(() => client.ping()), STARTUP_TIMEOUT_MS, "Redis ping");
    return client;
  } catch (cause) {
    void watch?.stop();
    client.disconnect();
    const sentinel = lastSentinelError ? ` (last sentinel error: ${lastSentinelError.message.replace(/\.$/, "")})` : "";
    throw new DependencyDown(
      `Cannot start: no sentinel of ${describeSentinels(target)} (REDIS_URL) names a master of ` +
        `"${target.service}" that answers: ${(cause as Error).message}${sentinel}.`,
      { cause },
    );
  }
}

/**
 * Reports, through `onNodeRefused`, the nodes of `target` that this process
 * may not reach. A new master is found when the connection to it is
 * refused: Deno refuses a host outside `--allow-net` with `NotCapable`, which
 * ioredis emits as the client's "error" (a sentinel's own failures come as
 * "sentinelError"), and the sentinels are then asked which node they name
 * the master. Replicas and sentinels are found by asking the sentinels
 * every `SENTINEL_NODES_CHECK_MS`, until the client ends.
 * @returns the periodic check, if one was started.
 */
function watchRefusedNodes(client: Redis, target: SentinelUrl, { onNodeRefused }: SentinelNodeOptions) {
  if (!onNodeRefused) return undefined;
  const reported = new Set<string>();
  const refuse = (node: SentinelNode) => {
    if (reported.has(`${node.role} ${node.address}`)) return;
    reported.add(`${node.role} ${node.address}`);
    onNodeRefused(node, target.service);
  };
  let asking = false;
  client.on("error", (error: Error) => {
    if (error?.name !== "NotCapable" || asking) return;
    asking = true;
    sentinelTopology(target)
      .then((nodes) => nodes.filter((n) => n.role === "master" && !netGranted(n.address)).forEach(refuse))
      .catch(() => {}) // the next refused attempt asks again
      .finally(() => (asking = false));
  });
  const watch = watchSentinelNodes(target, { onOutside: refuse });
  client.once("end", () => void watch.stop());
  return watch;
}

/**
 * Connects to Postgres and checks that it answers. DATABASE_URL may list
 * several hosts with `target_session_attrs=read-write` (or `primary`): every
 * new connection then tries them in turn until one is the primary, so after
 * a failover the pool reconnects to the promoted standby, and so does the
 * LISTEN connection (postgres.js LISTENs again on its own).
 * @throws {DependencyDown} naming the URL and how to start Postgres.
 */
/**
 * Why Postgres at `url` did not answer, and what to do: a Postgres that answers but lacks the database, or refuses
 * the credentials, is running, so advice to start it would mislead.
 */
function postgresRefusal(url: string, cause: unknown): string {
  const where = `Postgres at ${redactUrl(url)} (DATABASE_URL)`;
  const code = (cause as { code?: unknown })?.code;
  if (code === "3D000") {
    const database = decodeURIComponent(/^[^/]*\/\/[^/]*\/([^?#]*)/.exec(url)?.[1] ?? "");
    return `Cannot start: ${where} answers, but its database ${JSON.stringify(database)} does not exist. ` +
      `Create it with \`createdb ${database}\` (as a user allowed to), then run \`deno task migrate\`.`;
  }
  if (code === "28P01" || code === "28000") {
    return `Cannot start: ${where} answers, but refuses the user or password in DATABASE_URL: ` +
      `${(cause as Error).message}.`;
  }
  return `Cannot start: ${where} does not answer: ${(cause as Error).message}. ` +
    `Start it with \`docker compose up -d postgres\` or \`pg_ctlcluster 15 main start\`.`;
}

export async function connectPostgres(
  url: string,
  options: {
    max?: number;
    /** Seconds a connection lives before it is replaced; null: until it fails (postgres.js: 30-60 minutes). */
    maxLifetimeS?: number | null;
  } = {},
): Promise<Sql> {
  const target = new URLSearchParams(/\?([^#]*)/.exec(url)?.[1]).get("target_session_attrs");
  const sql = postgres(await answeringFirst(url), {
    max: options.max ?? 10,
    onnotice: () => {},
    connect_timeout: PG_CONNECT_TIMEOUT_S,
    idle_timeout: PG_IDLE_TIMEOUT_S,
    ...(options.maxLifetimeS !== undefined ? { max_lifetime: options.maxLifetimeS } : {}),
    // postgres.js 3.4 tells read-write by default_transaction_read_only alone, which a hot standby of
    // Postgres 14+ reports as off: it would connect to the standby, and every write would fail there
    // (hapostgres/pg_auto_failover#970). `primary` tells by in_hot_standby, as libpq does for read-write.
    ...(target === "read-write" ? { target_session_attrs: "primary" as const } : {}),
    // Each execution planned for its arguments and the table as it is: a prepared statement's generic plan made
    // while a table was small (a new deployment, or autovacuum off) stays a sequential scan as the table grows
    // (README, "Lanes at scale").
    connection: { application_name: "oncely", plan_cache_mode: "force_custom_plan" },
  });
  try {
    await withTimeout(sql`SELECT 1`, STARTUP_TIMEOUT_MS + 500, "Postgres query");
    return sql;
  } catch (cause) {
    await sql.end({ timeout: 0 });
    throw new DependencyDown(postgresRefusal(url, cause), { cause });
  }
}
