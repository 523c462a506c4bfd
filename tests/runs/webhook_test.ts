/**
 * Webhooks end to end: a POST with `notify: {"webhook": URL}`, a real worker
 * and a real relay, and a local receiver that verifies each delivery with the
 * README's own verification code. Retries, failures, refusals at POST time
 * and at send time, and secret rotation.
 */
import assert from "node:assert/strict";
import { tenantCommand } from "../../src/cli/tenant_command.ts";
import { outboxCommand } from "../../src/cli/outbox_command.ts";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { SUMMARY_WEBHOOK_KEY_PREFIX } from "../../src/runs/shapes.ts";
import { apiHandler, relayTo, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

type Verify = (secret: string, headers: Headers, body: string) => Promise<boolean>;

/** The README's verification block, written to a file and imported: the test runs exactly that code. */
async function readmeVerifier(): Promise<Verify> {
  const readme = await Deno.readTextFile(new URL("../../README.md", import.meta.url));
  const marker = readme.indexOf("<!-- verify-webhook:");
  assert.ok(marker > 0, "the README has the verification block");
  const start = readme.indexOf("```ts\n", marker) + "```ts\n".length;
  const code = readme.slice(start, readme.indexOf("```", start));
  const file = await Deno.makeTempFile({ suffix: ".ts" });
  await Deno.writeTextFile(file, code);
  const module = await import(new URL(`file://${file}`).href);
  await Deno.remove(file);
  return module.verifyOncelyWebhook as Verify;
}

interface Delivery {
  headers: Headers;
  body: string;
}

/** A receiver on loopback that records deliveries and answers what `answer` says. */
function startReceiver(
  answer: (n: number) => Response | Promise<Response> = () => new Response(null, { status: 204 }),
) {
  const deliveries: Delivery[] = [];
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
    deliveries.push({ headers: req.headers, body: await req.text() });
    return answer(deliveries.length);
  });
  return { url: `http://127.0.0.1:${server.addr.port}/hooks/oncely`, deliveries, close: () => server.shutdown() };
}

Deno.test("webhooks: signed, delivered once through the outbox, and never pointed inward", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const verify = await readmeVerifier();
  const created: string[] = [];
  await tenantCommand(db.sql, ["create", "acme"], (line) => created.push(line));
  const secret = created.find((line) => line.startsWith("whsec_"))!;
  assert.ok(secret, "tenant create prints the webhook signing secret");
  assert.ok(created.indexOf(secret) < created.length - 1, "before the key, which stays the last line");
  const apiKey = created.at(-1)!;
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", waiter });
  const stop = new AbortController();
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm: createExtractiveLlm(), keys });
  const running = worker.run(stop.signal);
  const relay = relayTo({ sql: db.sql }, { backoffBaseMs: 1, backoffCapMs: 5 });
  let n = 0;
  const post = (
    notify: unknown,
    headers: Record<string, string> = { prefer: "wait=10" },
    via: (req: Request) => Promise<Response> = handler,
  ) =>
    via(
      new Request("http://api/v1/summaries", {
        method: "POST",
        headers: {
          authorization: `Bearer ${apiKey}`,
          "content-type": "application/json",
          "idempotency-key": `webhook-key-${String(++n).padStart(8, "0")}`,
          ...headers,
        },
        body: JSON.stringify({ text: `Webhook document ${n}. It has two sentences.`, notify }),
      }),
    );
  const outboxOf = async (jobId: string) =>
    (await db.sql<{ id: string; sent: boolean; failed: boolean; last_error: string | null }[]>`
      SELECT id::text, sent_at IS NOT NULL AS sent, failed_at IS NOT NULL AS failed, last_error
      FROM outbox WHERE payload->>'job_id' = ${jobId}`)[0]!;
  /** Runs relay passes until the row is sent or failed (retries become due after a few ms). */
  const relayUntilSettled = async (jobId: string) => {
    for (let i = 0; i < 50; i++) {
      await relay.runOnce();
      const row = await outboxOf(jobId);
      if (row.sent || row.failed) return row;
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
    throw new Error(`outbox row of ${jobId} never settled`);
  };

  try {
    await t.step("a webhook job is delivered once, signed, and verifies with the README's code", async () => {
      const receiver = startReceiver();
      try {
        const res = await post({ webhook: receiver.url });
        assert.equal(res.status, 200);
        const { job_id, summary } = await res.json();
        await relayUntilSettled(job_id);
        await relay.runOnce(); // nothing left: no second delivery
        assert.equal(receiver.deliveries.length, 1);
        const [delivery] = receiver.deliveries;
        assert.equal(delivery!.headers.get("webhook-id"), `${SUMMARY_WEBHOOK_KEY_PREFIX}${job_id}`);
        assert.equal(delivery!.headers.get("content-type"), "application/json");
        assert.match(delivery!.headers.get("webhook-signature")!, /^v1,[A-Za-z0-9+/]+=*$/);
        assert.deepEqual(JSON.parse(delivery!.body), { type: "summary.ready", job_id, status: "done", summary });
        assert.equal(await verify(secret, delivery!.headers, delivery!.body), true);
        assert.equal(await verify(secret, delivery!.headers, delivery!.body.replace("two", "three")), false);
        assert.equal(
          await verify(`whsec_${btoa("another secret, 24 bytes!")}`, delivery!.headers, delivery!.body),
          false,
        );
        const [emails] = await db.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM outbox WHERE payload->>'job_id' = ${job_id} AND topic LIKE 'email.%'`;
        assert.equal(emails!.n, 0, "a webhook job sends no email");
      } finally {
        await receiver.close();
      }
    });

    await t.step("503 with Retry-After and 429 are retried; the same webhook-id arrives until a 2xx", async () => {
      const receiver = startReceiver((k) =>
        k === 1
          ? new Response("busy", { status: 503, headers: { "retry-after": "0" } })
          : k === 2
          ? new Response("slow down", { status: 429 })
          : new Response("ok")
      );
      try {
        const { job_id } = await (await post({ webhook: receiver.url })).json();
        const row = await relayUntilSettled(job_id);
        assert.ok(row.sent);
        assert.equal(receiver.deliveries.length, 3);
        assert.equal(new Set(receiver.deliveries.map((d) => d.headers.get("webhook-id"))).size, 1);
        for (const d of receiver.deliveries) assert.ok(await verify(secret, d.headers, d.body));
      } finally {
        await receiver.close();
      }
    });

    await t.step("another 4xx fails the row; outbox retry resends it", async () => {
      let accept = false;
      const receiver = startReceiver(() => new Response(null, { status: accept ? 200 : 400 }));
      try {
        const { job_id } = await (await post({ webhook: receiver.url })).json();
        const failed = await relayUntilSettled(job_id);
        assert.ok(failed.failed);
        assert.match(failed.last_error!, /400/);
        assert.equal(receiver.deliveries.length, 1, "a 400 is not retried");
        accept = true;
        assert.equal(await outboxCommand(db.sql, ["retry", failed.id], () => {}), 0);
        assert.ok((await relayUntilSettled(job_id)).sent);
        assert.equal(receiver.deliveries.length, 2);
      } finally {
        await receiver.close();
      }
    });

    await t.step("a redirect is refused, and its target never hears from us", async () => {
      const target = startReceiver();
      const redirector = startReceiver(() => Response.redirect(target.url, 307));
      try {
        const { job_id } = await (await post({ webhook: redirector.url })).json();
        const row = await relayUntilSettled(job_id);
        assert.ok(row.failed);
        assert.match(row.last_error!, /redirects are not followed/);
        assert.equal(redirector.deliveries.length, 1);
        assert.equal(target.deliveries.length, 0);
      } finally {
        await Promise.all([target.close(), redirector.close()]);
      }
    });

    await t.step(
      "POST refuses http, private addresses and credentials without the flags, naming the field",
      async () => {
        const strict = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
          authMode: "api-key",
          webhooks: { allowHttp: false, allowPrivate: false, hasSecret: () => Promise.resolve(true) },
        });
        const queued = await r.redis.xlen(keys.lane("acme").stream);
        const attempt = async (webhook: string) => {
          const res = await post({ webhook }, {}, strict);
          assert.equal(res.status, 422, webhook);
          const problem = await res.json();
          assert.equal(problem.errors[0].path, "notify.webhook");
          return problem.errors[0].message as string;
        };
        assert.match(await attempt("http://hooks.example.com/x"), /https.*WEBHOOK_ALLOW_HTTP/);
        assert.match(await attempt("https://127.0.0.1/x"), /private or loopback/);
        assert.match(await attempt("https://[::ffff:169.254.169.254]/latest/meta-data"), /private or loopback/);
        assert.match(await attempt("https://2130706433/x"), /private or loopback/);
        assert.match(await attempt("https://localhost:8000/x"), /private or loopback|localhost/);
        assert.match(await attempt("https://user:pw@hooks.example.com/x"), /user name or password/);
        const invalid = await post({ webhook: "not a url" }, {}, strict);
        assert.equal(invalid.status, 422);
        await invalid.body?.cancel();
        assert.equal(await r.redis.xlen(keys.lane("acme").stream), queued, "nothing refused was queued");
      },
    );

    await t.step("a tenant without a signing secret is told how to get one", async () => {
      await db.sql`UPDATE tenants SET webhook_secret = NULL WHERE name = 'acme'`;
      const fresh = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key" });
      const res = await post({ webhook: "https://hooks.example.com/x" }, {}, fresh);
      assert.equal(res.status, 422);
      assert.match((await res.json()).errors[0].message, /rotate-webhook-secret/);
      await db.sql`UPDATE tenants SET webhook_secret = ${secret} WHERE name = 'acme'`;
    });

    await t.step("at send time, a private address is refused without the flag, and nothing is sent", async () => {
      const receiver = startReceiver();
      const strictRelay = relayTo({ sql: db.sql, webhookPolicy: { allowHttp: true, allowPrivate: false } });
      try {
        const { job_id } = await (await post({ webhook: receiver.url })).json();
        await strictRelay.runOnce();
        const row = await outboxOf(job_id);
        assert.ok(row.failed, "refused for good, not retried");
        assert.match(row.last_error!, /private or loopback/);
        assert.equal(receiver.deliveries.length, 0);
      } finally {
        await receiver.close();
      }
    });

    await t.step("after rotate-webhook-secret, both secrets sign for a day; the new one is printed once", async () => {
      const out: string[] = [];
      assert.equal(await tenantCommand(db.sql, ["rotate-webhook-secret", "acme"], (line) => out.push(line)), 0);
      const rotated = out.at(-1)!;
      assert.match(rotated, /^whsec_/);
      assert.notEqual(rotated, secret);
      assert.equal(await tenantCommand(db.sql, ["rotate-webhook-secret", "nobody"], () => {}), 1);
      const receiver = startReceiver();
      try {
        const { job_id } = await (await post({ webhook: receiver.url })).json();
        await relayUntilSettled(job_id);
        const [delivery] = receiver.deliveries;
        assert.equal(delivery!.headers.get("webhook-signature")!.split(" ").length, 2);
        assert.ok(await verify(rotated, delivery!.headers, delivery!.body), "the new secret verifies");
        assert.ok(await verify(secret, delivery!.headers, delivery!.body), "the old one still does");
      } finally {
        await receiver.close();
      }
    });
  } finally {
    stop.abort();
    await running;
    await worker.close();
    await waiter.close();
    await r.close();
    await db.close();
  }
});
