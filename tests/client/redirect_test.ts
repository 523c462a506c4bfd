/** The typed client does not follow redirects: they would carry the API key and body elsewhere (issue 37). */
import assert from "node:assert/strict";
import { createClient, OncelyError } from "../../src/client/client.ts";

Deno.test("a redirect is an error naming it; the other address never sees the key or the body", async () => {
  const seen: { auth: string | null; body: string }[] = [];
  const elsewhere = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, async (req) => {
    seen.push({ auth: req.headers.get("authorization"), body: await req.text() });
    return Response.json({ job_id: crypto.randomUUID(), status: "queued" }, { status: 202 });
  });
  const to = `http://127.0.0.1:${(elsewhere.addr as Deno.NetAddr).port}`;
  const redirecting = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, (req) => {
    return new Response(null, { status: 307, headers: { location: `${to}${new URL(req.url).pathname}` } });
  });
  try {
    const client = createClient({
      baseUrl: `http://127.0.0.1:${(redirecting.addr as Deno.NetAddr).port}`,
      apiKey: "sk_secret",
      maxRetries: 0,
    });
    await assert.rejects(
      client.summarize({ text: "Revenue rose.", notify: "ops@example.com" }),
      (e: Error) => {
        assert.ok(e instanceof OncelyError, String(e));
        assert.equal(e.status, 307);
        assert.match(e.message, /does not follow redirects/);
        return true;
      },
    );
    assert.deepEqual(seen, [], "the other address got nothing");
  } finally {
    await redirecting.shutdown();
    await elsewhere.shutdown();
  }
});
