import assert from "node:assert/strict";
import { HttpError } from "../../src/http/problem.ts";
import { json, Router } from "../../src/http/router.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { apiMetrics, createRegistry } from "../../src/metrics/metrics.ts";

function app() {
  const registry = createRegistry();
  const items = new Router()
    .on("/items", { POST: () => json(201, { created: true }) })
    .on(/^\/items\/([^/]+)$/, {
      GET: (_req, { params }) => json(200, { id: params[0] }),
      DELETE: () => {
        throw new HttpError(409, "Cannot delete that");
      },
    }, "/items/{id}");
  const router = new Router()
    .mount("/admin", (req, { path }) => new Response(`admin ${req.method} ${path}`))
    .route(items)
    .on("/healthz", { GET: () => json(200, { status: "ok" }) });
  return { handler: router.handler({ log: silentLogger, metrics: apiMetrics(registry) }), registry };
}

Deno.test("a route serves its methods, GET also serves HEAD, and a pattern's groups are its params", async () => {
  const { handler } = app();
  const got = await handler(new Request("http://x/items/42"));
  assert.equal(got.status, 200);
  assert.deepEqual(await got.json(), { id: "42" });
  const head = await handler(new Request("http://x/healthz", { method: "HEAD" }));
  assert.equal(head.status, 200);
  await head.body?.cancel();
  const created = await handler(new Request("http://x/items", { method: "POST", body: "{}" }));
  assert.equal(created.status, 201);
  await created.body?.cancel();
});

Deno.test("another method on a known path is 405 with Allow; an unknown path is 404, or 501 for an unknown method", async () => {
  const { handler } = app();
  const cases: [string, string, number, string | null][] = [
    ["PUT", "/items/1", 405, "GET, DELETE"],
    ["FOO", "/items", 405, "POST"],
    ["GET", "/items", 405, "POST"],
    ["POST", "/healthz", 405, "GET"],
    ["GET", "/nowhere", 404, null],
    ["FOO", "/nowhere", 501, null],
  ];
  for (const [method, path, status, allow] of cases) {
    const res = await handler(new Request(`http://x${path}`, { method }));
    assert.equal(res.status, status, `${method} ${path}`);
    assert.equal(res.headers.get("allow"), allow, `${method} ${path}`);
    assert.equal(res.headers.get("content-type"), "application/problem+json", `${method} ${path}`);
    const body = await res.json();
    if (status === 404) assert.equal(body.detail, `No route for ${method} ${path}`);
  }
});

Deno.test("a mount takes its prefix and everything below it, whatever the method; an error becomes a problem", async () => {
  const { handler } = app();
  for (const [method, path] of [["GET", "/admin"], ["POST", "/admin/x/y"], ["FOO", "/admin/"]]) {
    const res = await handler(new Request(`http://x${path}`, { method }));
    assert.equal(await res.text(), `admin ${method} ${path}`);
  }
  const notMounted = await handler(new Request("http://x/administer"));
  assert.equal(notMounted.status, 404);
  await notMounted.body?.cancel();
  const refused = await handler(new Request("http://x/items/1", { method: "DELETE" }));
  assert.equal(refused.status, 409);
  assert.equal((await refused.json()).detail, "Cannot delete that");
});

Deno.test("requests are counted by their route's label and a served method, anything else as other", async () => {
  const { handler, registry } = app();
  for (const [method, path] of [["GET", "/items/1"], ["GET", "/items/2"], ["FOO", "/nowhere"], ["GET", "/admin/z"]]) {
    await (await handler(new Request(`http://x${path}`, { method }))).body?.cancel();
  }
  const lines = (await registry.metrics()).split("\n").filter((l) => l.startsWith("oncely_http_requests_total{"));
  assert.ok(
    lines.includes('oncely_http_requests_total{route="/items/{id}",method="GET",status="200"} 2'),
    lines.join("\n"),
  );
  assert.ok(
    lines.includes('oncely_http_requests_total{route="other",method="other",status="501"} 1'),
    lines.join("\n"),
  );
  assert.ok(lines.includes('oncely_http_requests_total{route="/admin",method="GET",status="200"} 1'), lines.join("\n"));
});
