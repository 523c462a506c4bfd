/**
 * Runs one command of the table: checks its permission set, opens the
 * clients it names, runs its code, and closes what it opened. Loaded by
 * `main.ts` only in the service process, never in the launcher.
 */
import { connectPostgres, connectRedis, DependencyDown } from "./clients.ts";
import { type Command, COMMAND_TABLE, type CommandSpec } from "./commands.ts";
import type { ClientNeeds, ClientsOf } from "./processes/run_context.ts";
import { type Config, postgresHosts } from "./config.ts";
import { checkCommitDurability } from "./db/commit_durability.ts";
import { createLogger } from "./log/logger.ts";
import { missingNetPermissions, missingRunPermission } from "./permissions.ts";
import { DEFAULT_ISOLATION } from "./tasks/pool_channels.ts";
import { refuseLoudly } from "./redis/sentinel_nodes.ts";

/**
 * @returns the process exit code: the command's, 2 when its permission set
 * lacks a configured host, 1 when Redis or Postgres does not answer.
 */
export async function runCommand(
  name: Command,
  { config, args, shutdown }: { config: Config; args: string[]; shutdown: () => AbortSignal },
): Promise<number> {
  const denied = missingNetPermissions(name, config);
  const cannotRun = missingRunPermission(name, DEFAULT_ISOLATION);
  if (cannotRun) denied.push(cannotRun);
  if (denied.length > 0) {
    console.error(denied[0]);
    return 2;
  }
  const log = createLogger({ level: config.LOG_LEVEL }).child({ process: name });
  const spec = COMMAND_TABLE[name] as CommandSpec<ClientNeeds>;
  const opened: {
    redis?: Awaited<ReturnType<typeof connectRedis>>;
    sql?: Awaited<ReturnType<typeof connectPostgres>>;
  } = {};
  try {
    if (spec.clients.sql) {
      opened.sql = await connectPostgres(config.DATABASE_URL);
      if (postgresHosts(config.DATABASE_URL)!.length > 1) {
        // A warning, not a refusal: an asynchronous standby is a choice (speed over acknowledged commits).
        await checkCommitDurability({ sql: opened.sql, log }).catch((error) =>
          log.warn("postgres_durability_unknown", { error })
        );
      }
    }
    if (spec.clients.redis) {
      opened.redis = await connectRedis(config.REDIS_URL, {
        name: "oncely",
        failFast: spec.failFast,
        // Behind Sentinel, a node that joined after start-up is outside this process's --allow-net.
        onNodeRefused: refuseLoudly({ log, exit: (code) => Deno.exit(code) }),
      });
    }
    const run = await spec.run();
    // The table says which clients the command gets, and exactly those were opened above.
    return await run({ config, args, log, clients: opened as ClientsOf<ClientNeeds>, shutdown });
  } catch (error) {
    if (error instanceof DependencyDown) {
      console.error(error.message);
      return 1;
    }
    throw error;
  } finally {
    await opened.sql?.end({ timeout: 5 });
    await opened.redis?.quit().catch(() => opened.redis?.disconnect());
  }
}
