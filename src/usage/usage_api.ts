/** `GET /v1/usage`: the calling tenant's own calls, tokens, cost, cache hits and budgets. */
import type { Sql } from "postgres";
import { HttpError } from "../http/problem.ts";
import { json, Router } from "../http/router.ts";
import type { Authenticate } from "../tenants/authenticator.ts";
import { DEFAULT_SINCE, parseSince } from "./since.ts";
import type { Budgets } from "../budgets/budgets.ts";
import { tenantUsage } from "./usage_report.ts";

/** The path of the usage report. */
export const USAGE = "/v1/usage";

/** What the usage route needs. */
export interface UsageApiDeps {
  sql: Sql;
  authenticate: Authenticate;
  /** The tenants' budgets (their spend and reservations); without them, `budgets` is empty. */
  budgets?: Pick<Budgets, "views">;
}

/** The window a request asks for (`since`, default 24h); a 400 for anything else in the query. */
function windowOf(req: Request): { since: string; sinceS: number } {
  const query = new URL(req.url).searchParams;
  for (const name of query.keys()) {
    if (name !== "since") throw new HttpError(400, `Unknown query parameter "${name}"; only since is read`);
  }
  const given = query.getAll("since");
  if (given.length > 1) throw new HttpError(400, "Give since once");
  const since = given[0] ?? DEFAULT_SINCE;
  try {
    return { since, sinceS: parseSince(since) };
  } catch (error) {
    throw new HttpError(400, (error as Error).message);
  }
}

/** The usage route. Every figure is the authenticated tenant's own: the tenant is the report's filter. */
export function usageRoutes(deps: UsageApiDeps): Router {
  return new Router().on(USAGE, {
    GET: async (req) => {
      const tenant = await deps.authenticate(req);
      const budgets = deps.budgets && ((t: string) => deps.budgets!.views(t));
      return json(200, await tenantUsage({ sql: deps.sql, budgets }, tenant, windowOf(req)));
    },
  });
}
