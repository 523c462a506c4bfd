/**
 * A small router: routes are a path (or a pattern whose groups are its
 * parameters) with a handler per method, or a mount that takes every request
 * at a prefix and below it. Routers compose (`route`, as Hono's
 * `app.route()`), and `handler()` turns one into the process's
 * `(req, client) => Promise<Response>`: one place that answers 404, 405
 * (with Allow), 501, and turns errors into problem documents, releases an
 * unread body, and counts each request by its route's label.
 */
import type { Logger } from "../log/logger.ts";
import { releaseUnreadBody } from "./body.ts";
import { errorResponse, HttpError, problem } from "./problem.ts";

/** The peer of a request, as `Deno.serve` passes it to a handler. */
export interface Client {
  remoteAddr?: Deno.Addr;
}

/** What a route's handler is given besides the request. */
export interface RouteContext {
  /** The request's path. */
  path: string;
  /** The pattern's groups, in order. */
  params: string[];
  client?: Client;
}

export type RouteHandler = (req: Request, ctx: RouteContext) => Promise<Response> | Response;

/** What {@linkcode Router.handler} counts of each request; the API process passes its `ApiMetrics`. */
export interface RequestMetrics {
  requests: { inc(labels: { route: string; method: string; status: string }): void };
  /** Seconds from the request's arrival to its answer. */
  duration: { observe(labels: { route: string; method: string }, seconds: number): void };
}

interface Route {
  match(path: string): string[] | null;
  /** The route's bounded label in metrics. */
  label: string;
  /** Handlers by method; absent for a mount. */
  methods?: Record<string, RouteHandler>;
  /** A mount's handler, for any method. */
  mount?: RouteHandler;
}

/** RFC 9110's methods and PATCH. Any other token is unknown: 501, or 405 on a known path. */
const STANDARD_METHODS: ReadonlySet<string> = new Set([
  "GET",
  "HEAD",
  "POST",
  "PUT",
  "DELETE",
  "CONNECT",
  "OPTIONS",
  "TRACE",
  "PATCH",
]);

/** A JSON response. */
export function json(status: number, body: unknown, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body), { status, headers: { ...headers, "content-type": "application/json" } });
}

/** Routes, matched in the order they were added. */
export class Router {
  readonly #routes: Route[] = [];

  /**
   * Serves `methods` at `path`: a literal path, or a pattern whose groups
   * become `ctx.params` (then `label` names it in metrics). GET also serves
   * HEAD; any other method gets 405 with an Allow header listing `methods`.
   */
  on(path: string | RegExp, methods: Record<string, RouteHandler>, label?: string): this {
    const match = typeof path === "string"
      ? (p: string) => (p === path ? [] : null)
      : (p: string) => path.exec(p)?.slice(1) ?? null;
    this.#routes.push({ match, label: label ?? String(path), methods });
    return this;
  }

  /** Hands every request at `prefix` or below it (`prefix/...`), whatever its method, to `handler`. */
  mount(prefix: string, handler: RouteHandler): this {
    const match = (p: string) => (p === prefix || p.startsWith(`${prefix}/`) ? [] : null);
    this.#routes.push({ match, label: prefix, mount: handler });
    return this;
  }

  /** Adds every route of `other`, after those already here. */
  route(other: Router): this {
    this.#routes.push(...other.#routes);
    return this;
  }

  /** The methods some route serves (HEAD with GET); any other is "other" in metrics. */
  served(): Set<string> {
    const methods = new Set<string>();
    for (const route of this.#routes) {
      for (const method of Object.keys(route.methods ?? {})) {
        methods.add(method);
        if (method === "GET") methods.add("HEAD");
      }
    }
    return methods;
  }

  #find(path: string): { route: Route; params: string[] } | undefined {
    for (const route of this.#routes) {
      const params = route.match(path);
      if (params) return { route, params };
    }
    return undefined;
  }

  /** Answers `req` at `path`; throws what a handler throws (an `HttpError` for 405 and 501). */
  dispatch(req: Request, path: string, client?: Client): Promise<Response> {
    return this.#answer(req, path, this.#find(path), client);
  }

  async #answer(
    req: Request,
    path: string,
    found: { route: Route; params: string[] } | undefined,
    client?: Client,
  ): Promise<Response> {
    if (!found) {
      if (!STANDARD_METHODS.has(req.method)) throw new HttpError(501, "This server does not implement that method");
      return problem(404, `No route for ${req.method} ${path}`);
    }
    const ctx: RouteContext = { path, params: found.params, client };
    if (found.route.mount) return await found.route.mount(req, ctx);
    const methods = found.route.methods!;
    const handle = methods[req.method] ?? (req.method === "HEAD" ? methods.GET : undefined);
    if (!handle) {
      const allow = Object.keys(methods).join(", ");
      throw new HttpError(405, `Use ${allow} on this path`, { allow });
    }
    return await handle(req, ctx);
  }

  /** The label `path` is counted under in metrics: its route's, or "other". */
  label(path: string): string {
    return this.#find(path)?.route.label ?? "other";
  }

  /**
   * The router as a plain `(req, client) => Promise<Response>` for
   * `Deno.serve` (and for tests, without a port).
   */
  handler(
    { log, metrics }: { log: Logger; metrics?: RequestMetrics },
  ): (req: Request, client?: Client) => Promise<Response> {
    const served = this.served();
    return async (req, client) => {
      const started = performance.now();
      // A malformed Host header (`Host: a b`) makes the request's URL unparseable: a client error, not a 500.
      const path = URL.parse(req.url)?.pathname;
      // Found once: the route answers the request and labels it in metrics.
      const found = path === undefined ? undefined : this.#find(path);
      let response: Response;
      try {
        if (path === undefined) throw new HttpError(400, "The request's Host header or target is not a valid URL");
        response = await this.#answer(req, path, found, client);
      } catch (error) {
        response = errorResponse(error, log, { method: req.method, path: path ?? "(malformed)" });
      }
      // A request answered before its body was read (401, 405, ...) must not keep its connection while the
      // client drips a body nobody will read.
      releaseUnreadBody(req);
      if (metrics) {
        // Bounded labels: a client may send any path and any token as its method.
        const labels = {
          route: found?.route.label ?? "other",
          method: served.has(req.method) ? req.method : "other",
        };
        metrics.requests.inc({ ...labels, status: String(response.status) });
        metrics.duration.observe(labels, (performance.now() - started) / 1000);
      }
      return response;
    };
  }
}
