import assert from "node:assert/strict";
import { canonicalJson } from "../../src/idempotency/fingerprint.ts";
import { jobIdFor } from "../../src/idempotency/scope.ts";
import { createIntake, type Intake } from "../../src/runs/intake.ts";
import { createRecipientPolicy } from "../../src/tenants/mail_domains.ts";
import { tenantCommand } from "../../src/cli/tenant_command.ts";
import { apiHandler } from "../support/fixtures.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createAuthenticator } from "../../src/tenants/authenticator.ts";
import { ensureWebhookSecret } from "../../src/tenants/webhook_secrets.ts";
import { createApiKey, revokeTenant } from "../../src/tenants/tenant_store.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";
import { rawConnect } from "../http/raw_client.ts";

const BODY = { text: "Quarterly revenue rose. Costs fell. The board approved the plan.", notify: "ops@example.com" };

Deno.test("summaries API", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const acme = keys.lane("acme");
  const intake = createIntake({ redis: r.redis }, { keys, resultTtlS: 86_400, path: "/v1/summaries" });
  const scopeOf = (key: string) => ({ tenant: "acme", method: "POST", path: "/v1/summaries", key });
  const handlerWith = (intake: Intake) =>
    apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", intake, maxBodyBytes: 4096 });
  const handlerWithOptions = (options: { bodyDeadlineMs: number }) =>
    apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", intake, maxBodyBytes: 4096, ...options });
  const handler = handlerWith(intake);
  const apiKey = await createApiKey(db.sql, "acme");
  const otherKey = await createApiKey(db.sql, "globex");
  let n = 0;
  const newKey = () => `test-key-${String(++n).padStart(8, "0")}`;
  const post = (key: string | null, body: unknown = BODY, headers: Record<string, string> = {}) =>
    handler(
      new Request("http://api/v1/summaries", {
        method: "POST",
        headers: {
          authorization: `Bearer ${apiKey}`,
          "content-type": "application/json",
          ...(key === null ? {} : { "idempotency-key": key }),
          ...headers,
        },
        body: typeof body === "string" ? body : JSON.stringify(body),
      }),
    );
  const get = (jobId: string, key = apiKey) =>
    handler(new Request(`http://api/v1/summaries/${jobId}`, { headers: { authorization: `Bearer ${key}` } }));
  const streamLength = () => r.redis.xlen(acme.stream);

  try {
    await t.step("POST accepts a job once: 202, Location, deterministic job id, one stream entry", async () => {
      const key = newKey();
      const before = await streamLength();
      const res = await post(key);
      assert.equal(res.status, 202);
      const body = await res.json();
      const expected = jobIdFor(scopeOf(key), canonicalJson(BODY));
      assert.deepEqual(body, { job_id: expected, status: "queued" });
      assert.equal(res.headers.get("location"), `/v1/summaries/${expected}`);
      assert.equal(res.headers.get("idempotent-replayed"), null);
      assert.equal(await streamLength(), before + 1);
      const [entry] = await r.redis.xrevrange(acme.stream, "+", "-", "COUNT", 1);
      const fields = entry![1];
      assert.deepEqual(fields.slice(0, 4), ["job_id", expected, "tenant", "acme"]);
      assert.deepEqual(JSON.parse(fields[5]!), BODY);
      // Queued: its tenant and no status (every reader reads a missing status as queued).
      assert.deepEqual(await r.redis.hgetall(acme.job(expected)), { tenant: "acme" });
    });

    await t.step("a repeat replays the stored response with Idempotent-Replayed and enqueues nothing", async () => {
      const key = newKey();
      const first = await (await post(key)).json();
      const before = await streamLength();
      // Same content, other key order and whitespace: the same fingerprint.
      const res = await post(key, `{ "notify": "${BODY.notify}",   "text": ${JSON.stringify(BODY.text)} }`);
      assert.equal(res.status, 202);
      assert.equal(res.headers.get("idempotent-replayed"), "true");
      assert.equal(res.headers.get("location"), `/v1/summaries/${first.job_id}`);
      assert.deepEqual(await res.json(), first);
      assert.equal(await streamLength(), before);
    });

    await t.step("the same key with another body is 422 and leaves the stored record alone", async () => {
      const key = newKey();
      await post(key);
      const before = await streamLength();
      const res = await post(key, { ...BODY, text: "Something else entirely." });
      assert.equal(res.status, 422);
      assert.equal(res.headers.get("content-type"), "application/problem+json");
      assert.match((await res.json()).detail, /different request body/);
      assert.equal(await streamLength(), before);
    });

    await t.step("20 concurrent duplicates: one enqueue, and every other answer is the same 202 replayed", async () => {
      const key = newKey();
      const before = await streamLength();
      const responses = await Promise.all(Array.from({ length: 20 }, () => post(key)));
      assert.deepEqual(
        new Set(responses.map((res) => res.status)),
        new Set([202]),
        "no 409: intake is one atomic step",
      );
      const replayed = responses.filter((res) => res.headers.get("idempotent-replayed") === "true").length;
      assert.equal(replayed, 19);
      const ids = new Set(await Promise.all(responses.map(async (res) => (await res.json()).job_id)));
      assert.equal(ids.size, 1);
      assert.equal(await streamLength(), before + 1);
    });

    await t.step(
      "a key reused with another body after its record expired names a new job, never the old one",
      async () => {
        const shortLived = createIntake({ redis: r.redis }, { keys, resultTtlS: 1, path: "/v1/summaries" });
        const briefly = handlerWith(shortLived);
        const key = newKey();
        const send = (body: unknown) =>
          briefly(
            new Request("http://api/v1/summaries", {
              method: "POST",
              headers: {
                authorization: `Bearer ${apiKey}`,
                "content-type": "application/json",
                "idempotency-key": key,
              },
              body: JSON.stringify(body),
            }),
          );
        const first = await (await send(BODY)).json();
        await shortLived.forget(scopeOf(key)); // the record's TTL has run out
        const other = { ...BODY, text: "A different document, sent months later with the same key." };
        const before = await streamLength();
        const res = await send(other);
        assert.equal(res.status, 202);
        assert.equal(res.headers.get("idempotent-replayed"), null);
        const second = await res.json();
        assert.notEqual(second.job_id, first.job_id, "the new body is its own job");
        assert.equal(await streamLength(), before + 1);
        const [entry] = await r.redis.xrevrange(acme.stream, "+", "-", "COUNT", 1);
        assert.equal(JSON.parse(entry![1][5]!).text, other.text);
      },
    );

    await t.step("an enqueue failure is a 500 problem without internals, and releases the key", async () => {
      const brokenKeys = {
        ...keys,
        // A lane's builders are methods: the broken lane keeps them, with its streams pointed elsewhere.
        lane: (tenant: string) =>
          Object.assign(Object.create(keys.lane(tenant)), {
            stream: acme.job("not-a-stream"),
            streamOf: () => acme.job("not-a-stream"),
          }),
      };
      const broken = handlerWith(
        createIntake({ redis: r.redis }, { keys: brokenKeys, resultTtlS: 60, path: "/v1/summaries" }),
      );
      const key = newKey();
      const jobId = jobIdFor(scopeOf(key), canonicalJson(BODY));
      // Make XADD fail: the "stream" key holds a hash.
      await r.redis.hset(acme.job("not-a-stream"), "x", "y");
      const res = await broken(
        new Request("http://api/v1/summaries", {
          method: "POST",
          headers: { authorization: `Bearer ${apiKey}`, "content-type": "application/json", "idempotency-key": key },
          body: JSON.stringify(BODY),
        }),
      );
      assert.equal(res.status, 500);
      const problem = await res.json();
      assert.doesNotMatch(JSON.stringify(problem), /WRONGTYPE|at |\.ts/);
      assert.equal(await intake.hasRecord(scopeOf(key)), false, "5xx is never stored");
      const retry = await post(key);
      assert.equal(retry.status, 202);
      assert.equal((await retry.json()).job_id, jobId);
    });

    await t.step("job ids are tenant-scoped, and a tenant named like a scope prefix cannot collide", async () => {
      const key = newKey();
      const a = await (await post(key)).json();
      const otherTenant = await (await post(key, BODY, { authorization: `Bearer ${otherKey}` })).json();
      assert.notEqual(a.job_id, otherTenant.job_id);
      const tricky = await createApiKey(db.sql, "acme.POST");
      const trickyId = jobIdFor(
        { tenant: "acme:POST", method: "POST", path: "/v1/summaries", key },
        canonicalJson(BODY),
      );
      const plainId = jobIdFor({ tenant: "acme", method: "POST:/v1/summaries", path: "", key }, canonicalJson(BODY));
      assert.notEqual(trickyId, a.job_id);
      assert.notEqual(plainId, a.job_id);
      const res = await post(key, BODY, { authorization: `Bearer ${tricky}` });
      assert.equal(res.headers.get("idempotent-replayed"), null, "another tenant never gets acme's replay");
      assert.notEqual((await res.json()).job_id, a.job_id);
    });

    await t.step("GET reports queued, done and failed, and 404s for other tenants and unknown ids", async () => {
      const key = newKey();
      const { job_id } = await (await post(key)).json();
      assert.deepEqual(await (await get(job_id)).json(), { job_id, status: "queued" });
      const other = await get(job_id, otherKey);
      assert.equal(other.status, 404);
      await other.body?.cancel();
      await db.sql`INSERT INTO summaries (job_id, tenant, summary) VALUES (${job_id}, 'acme', 'Revenue rose.')`;
      assert.deepEqual(await (await get(job_id)).json(), { job_id, status: "done", summary: "Revenue rose." });
      const notMine = await get(job_id, otherKey);
      assert.equal(notMine.status, 404);
      await notMine.body?.cancel();
      // A tenant sees a stable class of error, never the provider's or the database's own text.
      const providerText = "permanent: UpstreamHttpError: Upstream answered 401: " +
        '{"error":{"message":"Incorrect API key provided: sk-pro***3xQ (gateway llm-gw.internal.corp:8443)"}}';
      const failed = await (await post(newKey())).json();
      await r.redis.hset(acme.job(failed.job_id), "status", "failed", "error", providerText);
      assert.deepEqual(await (await get(failed.job_id)).json(), {
        job_id: failed.job_id,
        status: "failed",
        error: "model_rejected: 401",
      });
      const stored = await (await post(newKey())).json();
      await db.sql`INSERT INTO job_outcomes (job_id, tenant, outcome, error) VALUES (${stored.job_id}, 'acme', 'failed',
        'permanent: the summary cannot be stored: invalid byte sequence for encoding "UTF8": 0x00 (relation "summaries")')`;
      const storedDoc = await (await get(stored.job_id)).json();
      assert.deepEqual([storedDoc.status, storedDoc.error], ["failed", "storage_rejected"]);
      for (const id of [crypto.randomUUID(), "not-a-uuid"]) {
        const res = await get(id);
        assert.equal(res.status, 404);
        assert.equal(res.headers.get("content-type"), "application/problem+json");
        await res.body?.cancel();
      }
    });

    await t.step("401 for missing, malformed, unknown and revoked keys", async () => {
      const cases: Record<string, string>[] = [
        {},
        { authorization: "Basic abc" },
        { authorization: "Bearer onc_000000000000_" + "a".repeat(43) },
        { authorization: `Bearer ${apiKey}x` },
      ];
      for (const headers of cases) {
        const res = await handler(
          new Request("http://api/v1/summaries", {
            method: "POST",
            headers: { "content-type": "application/json", "idempotency-key": newKey(), ...headers },
            body: JSON.stringify(BODY),
          }),
        );
        assert.equal(res.status, 401, JSON.stringify(headers));
        assert.equal(res.headers.get("content-type"), "application/problem+json");
        await res.body?.cancel();
      }
      const doomed = await createApiKey(db.sql, "doomed");
      const ok = await post(newKey(), BODY, { authorization: `Bearer ${doomed}` });
      assert.equal(ok.status, 202);
      await ok.body?.cancel();
      await revokeTenant(db.sql, "doomed");
      const revoked = await post(newKey(), BODY, { authorization: `Bearer ${doomed}` });
      assert.equal(revoked.status, 401);
      await revoked.body?.cancel();
    });

    await t.step(
      "400 for a missing or malformed Idempotency-Key and for malformed JSON, enqueuing nothing",
      async () => {
        const before = await streamLength();
        for (const key of [null, "short", "x".repeat(129), "has space in it 123"]) {
          const res = await post(key);
          assert.equal(res.status, 400, String(key));
          await res.body?.cancel();
        }
        const res = await post(newKey(), "{not json");
        assert.equal(res.status, 400);
        assert.equal((await res.json()).status, 400);
        // The same key twice (also when one is escaped): JSON.parse would silently keep the last.
        for (
          const body of ['{"text":"a","text":"b","notify":"a@b.co"}', '{"text":"a","\\u0074ext":"b","notify":"a@b.co"}']
        ) {
          const dup = await post(newKey(), body);
          assert.equal(dup.status, 400, body);
          assert.match((await dup.json()).detail, /key "text" twice/);
        }
        assert.equal(await streamLength(), before);
      },
    );

    await t.step(
      "503 with Retry-After over a tenant's queue cap and over the whole queue's; replays still answer",
      async () => {
        const fresh = serviceKeys(`${r.prefix}:caps`);
        const capped = (limits: { maxQueued?: number; maxQueuedPerTenant?: number }) =>
          handlerWith(
            createIntake({ redis: r.redis }, { keys: fresh, resultTtlS: 60, path: "/v1/summaries", ...limits }),
          );
        const send = (h: (req: Request) => Promise<Response>, key: string, auth = apiKey) =>
          h(
            new Request("http://api/v1/summaries", {
              method: "POST",
              headers: { authorization: `Bearer ${auth}`, "content-type": "application/json", "idempotency-key": key },
              body: JSON.stringify(BODY),
            }),
          );
        const perTenant = capped({ maxQueuedPerTenant: 2 });
        const first = newKey();
        assert.equal((await send(perTenant, first)).status, 202);
        assert.equal((await send(perTenant, newKey())).status, 202);
        const full = await send(perTenant, newKey());
        assert.equal(full.status, 503);
        assert.equal(full.headers.get("retry-after"), "5");
        assert.match((await full.json()).detail, /tenant acme's queue is full/);
        assert.equal(await r.redis.xlen(fresh.lane("acme").stream), 2, "nothing enqueued over the cap");
        assert.equal(
          (await send(perTenant, first)).headers.get("idempotent-replayed"),
          "true",
          "a replay is not refused",
        );
        assert.equal((await send(perTenant, newKey(), otherKey)).status, 202, "another tenant has room");
        // The whole queue now holds 3 jobs; its size is read at most once a second.
        const whole = capped({ maxQueued: 3 });
        const over = await send(whole, newKey(), otherKey);
        assert.equal(over.status, 503);
        assert.match((await over.json()).detail, /the queue is full/);
        // A full queue still answers replays, and a tenant holding less than its share of it still gets in:
        // two lanes hold work, so each of three gets 3 / 3 = 1, and a third tenant with none is served.
        const replay = await send(whole, first);
        assert.equal(replay.status, 202, "a replay at the global cap is answered");
        assert.equal(replay.headers.get("idempotent-replayed"), "true");
        const thirdKey = await createApiKey(db.sql, "initech");
        assert.equal((await send(whole, newKey(), thirdKey)).status, 202, "a tenant under its share gets in");
        assert.equal((await send(whole, newKey())).status, 503, "acme, over its share, does not");
      },
    );

    await t.step(
      "a tenant restricted to some domains cannot mail others (422 on notify); allow-domain --any frees it",
      async () => {
        const restricted = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
          authMode: "api-key",
          intake,
          maxBodyBytes: 4096,
          recipients: createRecipientPolicy({ sql: db.sql }, { ttlMs: 0 }),
        });
        const to = (notify: string) =>
          restricted(
            new Request("http://api/v1/summaries", {
              method: "POST",
              headers: {
                authorization: `Bearer ${apiKey}`,
                "content-type": "application/json",
                "idempotency-key": newKey(),
              },
              body: JSON.stringify({ ...BODY, notify }),
            }),
          );
        assert.equal((await to("anyone@elsewhere.org")).status, 202, "no list: any domain");
        const c = { lines: [] as string[], out: (l: string) => c.lines.push(l) };
        assert.equal(await tenantCommand(db.sql, ["allow-domain", "acme", "Example.COM"], c.out), 0);
        assert.match(c.lines[0]!, /may email only: example\.com/);
        const before = await streamLength();
        const refused = await to("victim@elsewhere.org");
        assert.equal(refused.status, 422);
        assert.deepEqual((await refused.json()).errors, [{
          path: "notify",
          message: "this tenant may not email elsewhere.org",
        }]);
        assert.equal(await streamLength(), before, "nothing enqueued, nothing mailed");
        assert.equal((await to("ops@example.com")).status, 202);
        assert.equal(await tenantCommand(db.sql, ["allow-domain", "acme", "--any"], c.out), 0);
        assert.equal((await to("victim@elsewhere.org")).status, 202);
        assert.equal(await tenantCommand(db.sql, ["allow-domain", "acme", "not a domain"], c.out), 2);
      },
    );

    await t.step(
      "a tenant restricted to some webhook hosts cannot send to others (422 on notify.webhook); --any frees it",
      async () => {
        await ensureWebhookSecret(db.sql, "acme");
        const hook = (url: string) => post(newKey(), { ...BODY, notify: { webhook: url } });
        assert.equal((await hook("https://anything.example.net/hook")).status, 202, "no list: any host");
        const c = { lines: [] as string[], out: (l: string) => c.lines.push(l) };
        assert.equal(await tenantCommand(db.sql, ["allow-webhook-host", "acme", "Hooks.Example.COM."], c.out), 0);
        assert.match(c.lines[0]!, /may send webhooks only to: hooks\.example\.com/);
        const before = await streamLength();
        const refused = await hook("https://attacker.example.net/collect");
        assert.equal(refused.status, 422);
        assert.deepEqual((await refused.json()).errors, [{
          path: "notify.webhook",
          message: "this tenant may not send webhooks to attacker.example.net",
        }]);
        assert.equal(await streamLength(), before, "nothing enqueued");
        assert.equal((await hook("https://hooks.example.com:8443/in")).status, 202, "any port of a listed host");
        assert.equal(await tenantCommand(db.sql, ["allow-webhook-host", "acme", "--any"], c.out), 0);
        assert.equal((await hook("https://attacker.example.net/collect")).status, 202);
        assert.equal(await tenantCommand(db.sql, ["allow-webhook-host", "acme", "not a host!"], c.out), 2);
        assert.equal(await tenantCommand(db.sql, ["allow-webhook-host", "nobody", "a.example.com"], c.out), 1);
      },
    );

    await t.step("408 for a body that does not arrive in time, enqueuing nothing", async () => {
      const slow = handlerWithOptions({ bodyDeadlineMs: 100 });
      const before = await streamLength();
      let timer: ReturnType<typeof setInterval> | undefined;
      const dribble = new ReadableStream<Uint8Array>({
        start(controller) {
          controller.enqueue(new TextEncoder().encode('{"text": "a'));
          timer = setInterval(() => controller.enqueue(new TextEncoder().encode("a")), 30);
        },
        cancel() {
          clearInterval(timer);
        },
      });
      const res = await slow(
        new Request("http://api/v1/summaries", {
          method: "POST",
          headers: {
            authorization: `Bearer ${apiKey}`,
            "idempotency-key": newKey(),
            "content-type": "application/json",
          },
          body: dribble,
        }),
      );
      clearInterval(timer);
      assert.equal(res.status, 408);
      assert.match((await res.json()).detail, /did not arrive within 0.1 s/);
      assert.equal(await streamLength(), before);
    });

    await t.step("over a real socket, a 408 closes the connection (read returns null) within a second", async () => {
      const server = Deno.serve(
        { hostname: "127.0.0.1", port: 0, onListen: () => {} },
        handlerWithOptions({ bodyDeadlineMs: 300 }),
      );
      const conn = await rawConnect(server.addr.port);
      try {
        const before = await streamLength();
        await conn.write(
          `POST /v1/summaries HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer ${apiKey}\r\n` +
            `Idempotency-Key: ${newKey()}\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{"text": "a`,
        );
        const drip = conn.drip("a".repeat(150), 100);
        const { status, at } = await conn.statusLine(3_000);
        assert.equal(status, 408);
        const closedAt = await conn.closed(2_000);
        drip.stop();
        assert.notEqual(closedAt, "open", "the socket is still open 2 s after the 408");
        assert.ok(
          (closedAt as number) - at < 1_000,
          `closed ${Math.round((closedAt as number) - at)} ms after the 408`,
        );
        assert.equal(await streamLength(), before, "nothing enqueued");
      } finally {
        conn.close();
        await server.shutdown();
      }
    });

    await t.step("415 when the body is not JSON", async () => {
      const res = await post(newKey(), "text=hi", { "content-type": "application/x-www-form-urlencoded" });
      assert.equal(res.status, 415);
      assert.equal(res.headers.get("content-type"), "application/problem+json");
      await res.body?.cancel();
    });

    await t.step("413 for a body over MAX_BODY_BYTES, declared or streamed, without storing the key", async () => {
      const key = newKey();
      const big = JSON.stringify({ text: "x".repeat(5000), notify: "a@b.co" });
      const declared = await post(key, big);
      assert.equal(declared.status, 413);
      await declared.body?.cancel();
      // A chunked body with no Content-Length is cut off as soon as it passes the limit.
      let pulled = 0;
      const stream = new ReadableStream<Uint8Array>({
        pull(controller) {
          pulled++;
          if (pulled > 1000) controller.close();
          else controller.enqueue(new TextEncoder().encode("x".repeat(1024)));
        },
      });
      const res = await handler(
        new Request("http://api/v1/summaries", {
          method: "POST",
          headers: { authorization: `Bearer ${apiKey}`, "content-type": "application/json", "idempotency-key": key },
          body: stream,
        }),
      );
      assert.equal(res.status, 413);
      await res.body?.cancel();
      assert.ok(pulled < 10, `stopped reading early (pulled ${pulled} chunks)`);
      assert.equal(await intake.hasRecord(scopeOf(key)), false);
    });

    await t.step("422 for bodies that fail validation, listing the fields", async () => {
      const before = await streamLength();
      const cases = [
        { text: "", notify: "a@b.co" },
        { text: "hi", notify: "not-an-email" },
        { text: "hi" },
        { ...BODY, extra: true },
        [],
        "a string",
      ];
      for (const body of cases) {
        const res = await post(newKey(), JSON.stringify(body));
        assert.equal(res.status, 422, JSON.stringify(body));
        const problem = await res.json();
        assert.equal(problem.title, "Unprocessable Content");
        assert.ok(Array.isArray(problem.errors) && problem.errors.length > 0);
      }
      assert.equal(await streamLength(), before);
    });

    await t.step("422 naming the field for text the database cannot store: NUL, unpaired surrogates", async () => {
      const before = await streamLength();
      for (const text of ["before\u0000after", "lone \ud800 high", "lone \udc00 low"]) {
        const res = await post(newKey(), { text, notify: "a@b.co" });
        assert.equal(res.status, 422);
        const problem = await res.json();
        assert.equal(problem.errors[0].path, "text");
        assert.match(problem.errors[0].message, /NUL characters or unpaired surrogates/);
      }
      // Every string a tenant sends, not only the text: the webhook URL and the address too.
      for (const webhook of ["https://hooks.example.com/a\u0000b", "https://hooks.example.com/\ud800"]) {
        const res = await post(newKey(), { text: "Fine text.", notify: { webhook } });
        assert.equal(res.status, 422, JSON.stringify(webhook));
        const problem = await res.json();
        assert.ok(
          problem.errors.some((e: { path: string }) => e.path.startsWith("notify")),
          JSON.stringify(problem.errors),
        );
      }
      // A well-formed pair (an emoji) is fine.
      assert.equal((await post(newKey(), { text: "Revenue rose \ud83d\ude00.", notify: "a@b.co" })).status, 202);
      assert.equal(await streamLength(), before + 1, "nothing enqueued for the refused bodies");
    });

    await t.step(
      "a quoted Idempotency-Key (the draft's structured-field string) is the same key as the bare one",
      async () => {
        const key = newKey();
        const quoted = await post(null, BODY, { "idempotency-key": `"${key}"` });
        assert.equal(quoted.status, 202);
        const bare = await post(key);
        assert.equal(bare.status, 202);
        assert.equal(bare.headers.get("idempotent-replayed"), "true");
        assert.equal((await bare.json()).job_id, (await quoted.json()).job_id, "one job, not two");
        for (const malformed of ['"short"', '"unterminated']) {
          const res = await post(null, BODY, { "idempotency-key": malformed });
          assert.equal(res.status, 400, malformed);
          await res.body?.cancel();
        }
      },
    );

    await t.step("healthz, readyz, unknown routes and wrong methods", async () => {
      assert.equal((await handler(new Request("http://api/healthz"))).status, 200);
      const ready = await handler(new Request("http://api/readyz"));
      assert.equal(ready.status, 200);
      assert.deepEqual(await ready.json(), { status: "ready", redis: "ok", postgres: "ok" });
      const missing = await handler(new Request("http://api/nope"));
      assert.equal(missing.status, 404);
      await missing.body?.cancel();
      const wrong = await handler(new Request("http://api/v1/summaries"));
      assert.equal(wrong.status, 405);
      assert.equal(wrong.headers.get("allow"), "POST");
      await wrong.body?.cancel();
    });

    await t.step(
      "a POST refused before its body is read (401) does not keep the socket while the body drips",
      async () => {
        const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, handler);
        const conn = await rawConnect(server.addr.port);
        try {
          await conn.write(
            "POST /v1/summaries HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer onc_nope_nope\r\n" +
              "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{",
          );
          const { status, at } = await conn.statusLine(3_000);
          assert.equal(status, 401);
          const closedAt = await conn.closed(3_000);
          assert.notEqual(closedAt, "open", "the socket is still open 3 s after the 401, waiting for the body");
          assert.ok((closedAt as number) - at < 2_000);
        } finally {
          conn.close();
          await server.shutdown();
        }
      },
    );

    await t.step("a malformed Host header is a 400 problem document, not a 500 with a stack trace", async () => {
      const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, handler);
      try {
        const conn = await Deno.connect({ hostname: "127.0.0.1", port: server.addr.port });
        await conn.write(new TextEncoder().encode("GET /healthz HTTP/1.1\r\nHost: a b\r\nConnection: close\r\n\r\n"));
        let text = "";
        const buf = new Uint8Array(4096);
        for (let n = await conn.read(buf); n !== null; n = await conn.read(buf)) {
          text += new TextDecoder().decode(buf.subarray(0, n));
        }
        conn.close();
        assert.match(text, /^HTTP\/1\.1 400 /);
        assert.match(text, /content-type: application\/problem\+json/i);
        assert.match(text, /not a valid URL/);
      } finally {
        await server.shutdown();
      }
    });
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("trusted-header mode: only the gateway's secret, and only tenants that exist and are not revoked", async () => {
  const db = await createTestDatabase();
  try {
    const secret = "gateway-secret-0123456789";
    const auth = createAuthenticator({ sql: db.sql }, { mode: "trusted-header", gatewaySecret: secret, cacheTtlMs: 0 });
    await createApiKey(db.sql, "acme");
    const as = (headers: Record<string, string>) => auth(new Request("http://x", { headers }));
    const refused = (p: Promise<unknown>, detail: RegExp) =>
      assert.rejects(p, (e: { status?: number; detail?: string }) => e.status === 401 && detail.test(e.detail ?? ""));
    assert.equal(await as({ "x-gateway-secret": secret, "x-tenant-id": "acme" }), "acme");
    await refused(as({ "x-tenant-id": "acme" }), /X-Gateway-Secret/);
    await refused(as({ "x-gateway-secret": "guess-guess-guess-guess", "x-tenant-id": "acme" }), /X-Gateway-Secret/);
    await refused(as({ "x-gateway-secret": secret }), /X-Tenant-Id header is required/);
    await refused(as({ "x-gateway-secret": secret, "x-tenant-id": "a b" }), /not a valid tenant name/);
    await refused(as({ "x-gateway-secret": secret, "x-tenant-id": "nobody" }), /does not exist or is revoked/);
    await revokeTenant(db.sql, "acme");
    await refused(as({ "x-gateway-secret": secret, "x-tenant-id": "acme" }), /does not exist or is revoked/);
    assert.throws(() => createAuthenticator({ sql: db.sql }, { mode: "trusted-header" }), TypeError);
  } finally {
    await db.close();
  }
});
