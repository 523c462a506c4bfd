/**
 * Where an accepted POST's time goes: the API's handler built up step by
 * step, each variant its own server, so `deno task bench --only=ingest-profile`
 * can load each with wrk and show what every step costs under load.
 * Usage: ingest_variants.ts VARIANT PORT DATABASE_URL REDIS_URL PREFIX
 */
import { connectPostgres, connectRedis } from "../../src/clients.ts";
import { readJsonBody } from "../../src/http/body.ts";
import { jobIdFor } from "../../src/idempotency/scope.ts";
import { createLogger } from "../../src/log/logger.ts";
import { createApiHandler } from "../../src/processes/api_process.ts";
import { SUMMARIES } from "../../src/summaries/api.ts";
import { createIntake } from "../../src/runs/intake.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { parseSummaryRequest } from "../../src/runs/shapes.ts";
import { summaryForms } from "../../src/runs/run_payload.ts";
import { createAuthenticator } from "../../src/tenants/authenticator.ts";
import { bareHandler, floorHandler } from "./baseline_handlers.ts";

/** The variants, each adding one step to the one before. */
export const VARIANTS = [
  ["bare", "bare Deno.serve: req.json() and a 202"],
  ["headers", "+ URL and the four request headers read"],
  ["body", "+ the body read and decoded as the API does (readJsonBody)"],
  ["auth", "+ API-key authentication (a key verified before: cached row, one constant-time comparison)"],
  ["validate", "+ validation (parseSummaryRequest) and the job id (canonical JSON, one SHA-1)"],
  ["log", "+ the job_enqueued log line"],
  ["handler", "the API handler with an intake that does nothing"],
  ["api", "the API handler with the real one-script intake"],
  ["floor", "bare Deno.serve plus the one Redis script an accepted POST must run (the design's floor)"],
] as const;

if (import.meta.main) {
  const [variant, port, databaseUrl, redisUrl, prefix] = Deno.args;
  const sql = await connectPostgres(databaseUrl!);
  const redis = await connectRedis(redisUrl!, { failFast: true });
  const keys = serviceKeys(prefix!);
  const log = createLogger({ level: "info" });
  const auth = createAuthenticator({ sql }, { mode: "api-key" });
  const accepted = (id = "00000000-0000-5000-8000-000000000000") =>
    new Response(JSON.stringify({ job_id: id, status: "queued" }), {
      status: 202,
      headers: { "content-type": "application/json", location: `${SUMMARIES}/${id}` },
    });
  const steps = async (req: Request, upTo: number) => {
    new URL(req.url);
    const key = req.headers.get("idempotency-key")!;
    req.headers.get("authorization");
    req.headers.get("content-type");
    if (upTo < 2) {
      await req.json();
      return accepted();
    }
    const tenant = upTo >= 3 ? await auth(req) : "bench";
    const body = await readJsonBody(req, 1 << 20);
    if (upTo < 4) return accepted();
    const parsed = parseSummaryRequest(body);
    if (!parsed.success) throw parsed.error;
    const id = jobIdFor({ tenant, method: "POST", path: SUMMARIES, key }, summaryForms(parsed.data).canonical);
    if (upTo >= 5) log.info("job_enqueued", { job_id: id, tenant });
    return accepted(id);
  };
  const accept = () =>
    Promise.resolve({
      response: { status: 202, body: { job_id: "x", status: "queued" as const }, headers: {} },
      replayed: false,
      jobId: "x",
    });
  const nothing = {
    submit: accept,
    submitRun: accept,
    hasRecord: () => Promise.resolve(false),
    forget: () => Promise.resolve(),
  };
  const index = VARIANTS.findIndex(([name]) => name === variant);
  const handler = variant === "bare"
    ? bareHandler()
    : variant === "floor"
    ? floorHandler(redis, prefix!)
    : variant === "handler" || variant === "api"
    ? createApiHandler({
      redis,
      sql,
      log,
      authenticate: auth,
      intake: variant === "api" ? createIntake({ redis }, { keys, resultTtlS: 600, path: SUMMARIES }) : nothing,
      keys,
      maxBodyBytes: 1 << 20,
    })
    : (req: Request) => steps(req, index);
  const server = Deno.serve(
    { hostname: "127.0.0.1", port: Number(port), onListen: () => console.log("ready") },
    handler,
  );
  Deno.addSignalListener("SIGTERM", () => void server.shutdown());
  await server.finished;
  await sql.end();
  await redis.quit();
}
