/**
 * The operator console in a real browser: headless Chromium (Debian's
 * `chromium`) against the API served over HTTP, with a real worker and real
 * data. It signs in through the form, sees a dead-lettered job, replays it
 * with the button, and sees it done; planted `<script>` never runs; every
 * page is saved as a screenshot (to CONSOLE_SCREENSHOTS, or a temp dir).
 */
import assert from "node:assert/strict";
import { createConsole } from "../../src/console/console.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { deadLetter } from "../../src/queue/dead_letter.ts";
import { commitResults } from "../../src/summaries/commit.ts";
import { serviceKeys } from "../../src/summaries/keys.ts";
import { markFailedHook } from "../../src/summaries/job_status.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { errorBody, startFakeModel } from "../support/fake_model_server.ts";
import { launchBrowser } from "../support/browser.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const TOKEN = "console-test-admin-token-0123456789";

Deno.test("without ADMIN_TOKEN the console is off: 404", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  try {
    const handler = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) });
    for (const path of ["/console", "/console/login", "/console/dead-letters"]) {
      const res = await handler(new Request(`http://api${path}`));
      assert.equal(res.status, 404, path);
      await res.body?.cancel();
    }
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("the console in headless Chromium: sign in, see a dead letter, replay it, see it done", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const shots = Deno.env.get("CONSOLE_SCREENSHOTS") ?? await Deno.makeTempDir({ prefix: "oncely-console-" });
  await Deno.mkdir(shots, { recursive: true });
  // Documents marked POISON are refused by the model (a 400: dead-lettered at once) until it is "fixed".
  let poisoned = true;
  const model = startFakeModel((_, prompt) =>
    poisoned && prompt.includes("POISON")
      ? { kind: "status", status: 400, body: errorBody("This model refuses the document.", "invalid_request_error") }
      : { kind: "ok", usage: { prompt_tokens: 321, completion_tokens: 45 } }
  );
  const operatorConsole = await createConsole({
    redis: r.redis,
    sql: db.sql,
    keys,
    log: silentLogger,
    token: TOKEN,
    maxBodyBytes: 1 << 20,
    providerStatus: () => Promise.resolve(["breaker: closed", "requests/min: 600 (configured)"]),
  });
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", console: operatorConsole });
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, handler);
  const base = `http://127.0.0.1:${server.addr.port}`;
  const stop = new AbortController();
  const worker = summaryWorker({
    redis: r.redis,
    sql: db.sql,
    llm: createOpenAiLlm({ apiKey: "k", model: "gpt-test", baseURL: model.url }),
    keys,
  }, { job: { budgetMs: 5_000, perCallTimeoutMs: 2_000, maxAttempts: 2, model: "gpt-test" } });
  const running = worker.run(stop.signal);
  const apiKey = await createApiKey(db.sql, "acme");
  const post = async (text: string, key: string) => {
    const res = await fetch(`${base}/v1/summaries`, {
      method: "POST",
      headers: { authorization: `Bearer ${apiKey}`, "content-type": "application/json", "idempotency-key": key },
      body: JSON.stringify({ text, notify: "ops@example.com" }),
    });
    return (await res.json()).job_id as string;
  };
  // Hostile text: if any of it ran, the page's body would carry data-pwned.
  const planted = `<script>document.body.dataset.pwned = "script"</script>` +
    `<img src=x onerror="document.body.dataset.pwned = 'img'"> POISON quarterly report. Costs fell.`;
  const browser = await launchBrowser();
  const notPwned = async (where: string) =>
    assert.equal(await browser.eval("document.body.dataset.pwned ?? null"), null, `no planted script ran on ${where}`);
  try {
    const poisonJob = await post(planted, "console-test-poison-0001");
    const goodJob = await post("Revenue rose 12%. Costs fell. The board approved the plan.", "console-test-good-00001");
    await waitFor(
      "the poison job to be dead-lettered",
      async () => (await r.redis.xlen(keys.lane("acme").dead)) === 1,
      10_000,
    );
    await waitFor("the good job", async () => {
      const [row] = await db.sql`SELECT 1 FROM summaries WHERE job_id = ${goodJob}`;
      return Boolean(row);
    }, 10_000);
    // A tenant name nobody could create, planted straight into a dead-letter stream, as hostile data would be.
    await deadLetter(
      r.redis,
      keys.lane("acme"),
      {
        id: "1-1",
        fields: {
          job_id: crypto.randomUUID(),
          tenant: `<script>document.body.dataset.pwned = "tenant"</script>`,
          payload: JSON.stringify({ text: "x", notify: "a@b.co" }),
        },
        deliveries: 1,
      },
      "planted",
      markFailedHook,
    );
    // A failed outbox row for the retry button.
    const failedJob = crypto.randomUUID();
    await commitResults(db.sql, [{ jobId: failedJob, tenant: "acme", summary: "S.", notify: "x@example.com" }]);
    await db.sql`UPDATE outbox SET failed_at = now(), attempts = 10, last_error = 'http_422: <b>bad</b>'
      WHERE payload->>'job_id' = ${failedJob}`;

    await t.step("signing in: the form sets an HttpOnly, SameSite=Strict cookie that is not the token", async () => {
      assert.match(await browser.goto(`${base}/console`), /\/console\/login$/, "redirected to the login form");
      await browser.screenshot(`${shots}/login.png`);
      await browser.eval(`document.querySelector("input[name=token]").value = "wrong-token-wrong-token"`);
      await browser.navigateBy(`document.querySelector("form").submit()`);
      assert.match(await browser.eval<string>("document.body.innerText"), /not the admin token/);
      await browser.eval(`document.querySelector("input[name=token]").value = ${JSON.stringify(TOKEN)}`);
      assert.match(await browser.navigateBy(`document.querySelector("form").submit()`), /\/console$/);
      assert.equal(await browser.eval("document.cookie"), "", "the session cookie is HttpOnly: no script sees it");
      const res = await fetch(`${base}/console/login`, {
        method: "POST",
        headers: { "content-type": "application/x-www-form-urlencoded" },
        body: new URLSearchParams({ token: TOKEN }),
        redirect: "manual",
      });
      const cookie = res.headers.get("set-cookie")!;
      assert.match(cookie, /HttpOnly/);
      assert.match(cookie, /SameSite=Strict/);
      assert.ok(!cookie.includes(TOKEN));
    });

    await t.step("queues, workers, outbox and provider pages render real data", async () => {
      await browser.goto(`${base}/console`);
      const queues = await browser.eval<string[][]>(
        `[...document.querySelectorAll("tbody tr")].map((tr) => [...tr.cells].map((c) => c.innerText))`,
      );
      assert.ok(queues.some((row) => row[0] === "acme"), JSON.stringify(queues));
      await notPwned("queues");
      await browser.screenshot(`${shots}/queues.png`);
      await browser.goto(`${base}/console/workers`);
      assert.match(await browser.eval<string>("document.querySelector('tbody').innerText"), /test/);
      await browser.screenshot(`${shots}/workers.png`);
      await browser.goto(`${base}/console/provider`);
      assert.match(await browser.eval<string>("document.querySelector('pre').innerText"), /breaker: closed/);
      await browser.screenshot(`${shots}/provider.png`);
      await browser.goto(`${base}/console/outbox`);
      assert.match(await browser.eval<string>("document.body.innerText"), /<b>bad<\/b>/, "error text shown as text");
      await browser.screenshot(`${shots}/outbox.png`);
      await browser.navigateBy(`[...document.querySelectorAll("button")].find((b) => b.innerText === "Retry").click()`);
      assert.match(
        await browser.eval<string>("document.querySelector('.note').innerText"),
        /1 row\(s\) made due again/,
      );
      const [row] = await db.sql`SELECT failed_at FROM outbox WHERE payload->>'job_id' = ${failedJob}`;
      assert.equal(row!.failed_at, null);
    });

    await t.step("the dead letters page shows planted script as text; Replay re-runs the job to done", async () => {
      await browser.goto(`${base}/console/dead-letters`);
      await notPwned("dead letters");
      const text = await browser.eval<string>("document.querySelector('table').innerText");
      assert.match(text, /<script>document\.body\.dataset\.pwned = "tenant"<\/script>/, "the tenant, escaped");
      assert.match(text, /<script>document\.body\.dataset\.pwned = "script"<\/script>/, "the document, escaped");
      assert.equal(await browser.eval("document.querySelectorAll('main script, main img').length"), 0);
      assert.match(text, /permanent/);
      await browser.screenshot(`${shots}/dead-letters.png`);
      poisoned = false; // the cause is fixed
      const rowIndex = await browser.eval<number>(
        `[...document.querySelectorAll("tbody tr")].findIndex((tr) => tr.innerText.includes(${
          JSON.stringify(poisonJob)
        }))`,
      );
      assert.ok(rowIndex >= 0);
      await browser.navigateBy(`document.querySelectorAll("tbody tr")[${rowIndex}].querySelector("button").click()`);
      assert.match(
        await browser.eval<string>("document.querySelector('.note').innerText"),
        /1 dead letter\(s\) replayed/,
      );
      await waitFor("the replayed job to finish, its attempts recorded", async () => {
        const [row] = await db.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM model_attempts WHERE job_id = ${poisonJob} AND outcome = 'ok'`;
        return row!.n === 1;
      }, 10_000);
      await browser.goto(`${base}/console/jobs/${poisonJob}`);
      await notPwned("the job page");
      assert.equal(await browser.eval("document.getElementById('job-status').innerText"), "done");
      const attempts = await browser.eval<string[][]>(
        `[...document.querySelectorAll("tbody tr")].map((tr) => [...tr.cells].map((c) => c.innerText))`,
      );
      assert.deepEqual(attempts.map((a) => a[4]), ["give_up", "ok"], "the refused call, then the replayed one");
      assert.equal(attempts[1]![6], "321 / 45");
      assert.match(await browser.eval<string>("document.querySelector('pre.summary').innerText"), /<script>/);
      await browser.screenshot(`${shots}/job.png`);
    });

    await t.step(
      "actions need the CSRF token; only a session the server holds counts; the bearer header works",
      async () => {
        const bearer = { authorization: `Bearer ${TOKEN}` };
        const page = await fetch(`${base}/console/dead-letters`, { headers: bearer });
        assert.equal(page.status, 200);
        assert.equal(page.headers.get("content-security-policy")?.includes("script-src 'self'"), true);
        await page.body?.cancel();
        const forged = await fetch(`${base}/console/dead-letters/replay`, {
          method: "POST",
          headers: { ...bearer, "content-type": "application/x-www-form-urlencoded" },
          body: new URLSearchParams({ all: "1", csrf: "guessed" }),
        });
        assert.equal(forged.status, 403);
        await forged.body?.cancel();
        // A cookie signed with the token but naming no session the server holds (the format before sessions
        // lived in Redis: the sign-in time and its HMAC) is not a sign-in.
        const key = await crypto.subtle.importKey(
          "raw",
          new TextEncoder().encode(TOKEN),
          { name: "HMAC", hash: "SHA-256" },
          false,
          ["sign"],
        );
        const issued = Math.floor(Date.now() / 1000);
        const mac = await crypto.subtle.sign(
          "HMAC",
          key,
          new TextEncoder().encode(`oncely-console-session-v1:${issued}`),
        );
        const b64 = btoa(String.fromCharCode(...new Uint8Array(mac))).replace(/\+/g, "-").replace(/\//g, "_")
          .replace(/=+$/, "");
        const unheld = await fetch(`${base}/console/outbox`, {
          headers: { cookie: `oncely_console=${issued}.${b64}` },
          redirect: "manual",
        });
        assert.equal(unheld.status, 303);
        await unheld.body?.cancel();
        const signIn = await fetch(`${base}/console/login`, {
          method: "POST",
          body: new URLSearchParams({ token: TOKEN }),
          redirect: "manual",
        });
        const cookie = signIn.headers.get("set-cookie")!.split(";")[0]!;
        await signIn.body?.cancel();
        const held = await fetch(`${base}/console/outbox`, { headers: { cookie }, redirect: "manual" });
        assert.equal(held.status, 200, "a session the server holds is accepted (the check is real)");
        await held.body?.cancel();
        const anonymous = await fetch(`${base}/console/outbox`, { redirect: "manual" });
        assert.equal(anonymous.status, 303);
        assert.equal(anonymous.headers.get("location"), "/console/login");
        await anonymous.body?.cancel();
      },
    );
  } finally {
    console.log(`console screenshots: ${shots}`);
    await browser.close();
    stop.abort();
    await running;
    await worker.close();
    await server.shutdown();
    await model.close();
    await r.close();
    await db.close();
  }
});
