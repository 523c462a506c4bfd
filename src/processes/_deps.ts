import type { Sql } from "postgres";
import type { Registry } from "prom-client";
import type { RedisClient } from "../clients.ts";
import type { Config } from "../config.ts";
import type { Logger } from "../log/logger.ts";

/** What a long-running component (API, worker, relay) gets from its process: `dev` runs all three on one set. */
export interface ComponentDeps {
  config: Config;
  redis: RedisClient;
  sql: Sql;
  log: Logger;
  /** The process's metrics; `dev` shares one between its components. */
  registry: Registry;
}
