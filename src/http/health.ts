/** The health checks: `/healthz` (the process answers) and `/readyz` (Redis and Postgres answer, within 1 s). */
import type { Sql } from "postgres";
import { withTimeout } from "../async/timeout.ts";
import type { RedisClient } from "../clients.ts";
import type { Logger } from "../log/logger.ts";
import { json, Router } from "./router.ts";

const READY_TIMEOUT_MS = 1_000;

/**
 * `/readyz`: 200 when Redis and Postgres both answer, else 503 naming the one that did not. Without `redis` (the
 * relay uses none), Postgres alone.
 */
export async function ready({ redis, sql, log }: { redis?: RedisClient; sql: Sql; log: Logger }): Promise<Response> {
  const check = async (what: string, probe: () => Promise<unknown>) => {
    try {
      await withTimeout(probe(), READY_TIMEOUT_MS, what);
      return "ok";
    } catch (error) {
      log.warn("readiness_check_failed", { dependency: what, error });
      return "unavailable";
    }
  };
  const [r, p] = await Promise.all([
    redis ? check("redis", () => redis.ping()) : undefined,
    check("postgres", () => sql`SELECT 1`),
  ]);
  const ok = r !== "unavailable" && p === "ok";
  return json(ok ? 200 : 503, { status: ok ? "ready" : "not ready", ...(r ? { redis: r } : {}), postgres: p });
}

/** The routes `/healthz` and `/readyz`. */
export function healthRoutes(deps: { redis: RedisClient; sql: Sql; log: Logger }): Router {
  return new Router()
    .on("/healthz", { GET: () => json(200, { status: "ok" }) })
    .on("/readyz", { GET: () => ready(deps) });
}
