/**
 * What a command's code receives from the host that runs it. The processes
 * import it from here, below the command table that loads them.
 */
import type { Sql } from "postgres";
import type { RedisClient } from "../clients.ts";
import type { Config } from "../config.ts";
import type { Logger } from "../log/logger.ts";

/** The clients a command gets, opened before it runs and closed after. */
export interface ClientNeeds {
  redis?: true;
  sql?: true;
}

/** The clients named by `N`, all present. */
export type ClientsOf<N extends ClientNeeds> =
  & (N extends { redis: true } ? { redis: RedisClient } : Record<never, never>)
  & (N extends { sql: true } ? { sql: Sql } : Record<never, never>);

/** What a command's code receives. */
export interface RunContext<N extends ClientNeeds> {
  config: Config;
  args: string[];
  log: Logger;
  clients: ClientsOf<N>;
  /** Installs the SIGTERM/SIGINT handlers and returns the signal they abort (long-running processes only). */
  shutdown(): AbortSignal;
}
