/**
 * The server side of the ingest benchmark, run as its own process so the load
 * generator does not share its CPU. `api`: the real handler with Redis and
 * Postgres (the real process is `main.ts api`: `run.ts` starts that for the
 * ingest rows). `bare`: a plain Deno.serve handler that parses the same JSON
 * and returns the same 202, the ceiling of the HTTP layer. `floor`: `bare`
 * plus the one Redis script an accepted POST must run (`baseline_handlers.ts`).
 * Usage: ingest_server.ts api|bare|floor PORT DATABASE_URL REDIS_URL PREFIX
 */
import { connectPostgres, connectRedis } from "../../src/clients.ts";
import { createIntake } from "../../src/runs/intake.ts";
import { createLogger } from "../../src/log/logger.ts";
import { createApiHandler } from "../../src/processes/api_process.ts";
import { SUMMARIES } from "../../src/summaries/api.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createAuthenticator } from "../../src/tenants/authenticator.ts";
import { createDefinitionChecker } from "../../src/tasks/definition_checker.ts";
import { bareHandler, floorHandler } from "./baseline_handlers.ts";

const [mode, port, databaseUrl, redisUrl, prefix] = Deno.args;
const close: (() => Promise<unknown>)[] = [];
let handler: (req: Request) => Promise<Response>;
if (mode === "bare") {
  handler = bareHandler();
} else if (mode === "floor") {
  const redis = await connectRedis(redisUrl!, { failFast: true });
  close.push(() => redis.quit());
  handler = floorHandler(redis, prefix!);
} else {
  // The real logger at the default level: one line per accepted job goes to stderr, as in production.
  const log = createLogger({ level: "info" });
  const sql = await connectPostgres(databaseUrl!);
  const redis = await connectRedis(redisUrl!);
  // Closed as the API process closes it: a live check Worker would keep this process from exiting.
  const definitions = createDefinitionChecker();
  close.push(() => sql.end(), () => redis.quit(), () => definitions.close());
  handler = createApiHandler({
    definitions,
    redis,
    sql,
    log,
    authenticate: createAuthenticator({ sql }, { mode: "api-key" }),
    intake: createIntake({ redis }, { keys: serviceKeys(prefix!), resultTtlS: 600, path: SUMMARIES }),
    keys: serviceKeys(prefix!),
    maxBodyBytes: 1 << 20,
  });
}
const server = Deno.serve({ hostname: "127.0.0.1", port: Number(port), onListen: () => console.log("ready") }, handler);
Deno.addSignalListener("SIGTERM", () => void server.shutdown());
await server.finished;
for (const c of close) await c();
