/**
 * What the console's modules are handed: everything the console reads and
 * acts on, and the part of it the pages read. `console.ts` and `pages.ts`
 * export them.
 */
import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import type { ReplicaAck } from "../redis/replica_ack.ts";
import type { Logger } from "../log/logger.ts";
import type { ServiceKeys } from "../runs/keys.ts";
import type { AdminAuthOptions } from "./admin_auth.ts";

/** What the console reads and acts on. */
export interface ConsoleDeps {
  redis: RedisClient;
  sql: Sql;
  keys: ServiceKeys;
  log: Logger;
  /** ADMIN_TOKEN. */
  token: string;
  /** MAX_BODY_BYTES: a form above it is refused (413) before anything is checked. */
  maxBodyBytes: number;
  /** How long a form may take to arrive; default 10 s (`BODY_DEADLINE_MS`). */
  bodyDeadlineMs?: number;
  /** The token check's pace and the sessions' lifetime; defaults in `ADMIN_AUTH_DEFAULTS`. */
  auth?: Partial<AdminAuthOptions>;
  /** REDIS_MIN_REPLICAS_ACK: a dead-letter replay waits for the replicas, as `dlq replay` does; absent when 0. */
  ack?: ReplicaAck;
  /** The shared limiter and breaker, as `deno task provider status` prints it; absent without one. */
  providerStatus?: () => Promise<string[]>;
  /** The time the charts end at (epoch ms); `Date.now` unless a test fixes it. */
  now?: () => number;
  /** The deployments of LLM_DEPLOYMENTS marked `"batch": true` (the Batches page); none when absent. */
  batchDeployments?: readonly string[];
}

/** What the pages read. */
export type PageDeps = Pick<ConsoleDeps, "redis" | "sql" | "keys" | "providerStatus" | "now" | "batchDeployments">;
