/**
 * The operator console in a real browser: headless Chromium (Debian's
 * `chromium`) against the API served over HTTP, with a real worker and real
 * data. It signs in through the form, sees a dead-lettered job, replays it
 * with the button, and sees it done; planted `<script>` never runs; every
 * page is saved as a screenshot (to CONSOLE_SCREENSHOTS, or a temp dir).
 * The task pages and the page of a task's run are read over the bearer
 * header, from rows written as the worker writes them.
 */
import assert from "node:assert/strict";
import { createConsole } from "../../src/console/console.ts";
import { putTaskVersion } from "../../src/jobs/task_store.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { deadLetter } from "../../src/queue/dead_letter.ts";
import { commitResults, expireRun } from "../../src/runs/commit.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { markFailedHook } from "../../src/runs/job_status.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { errorBody, startFakeModel } from "../support/fake_model_server.ts";
import { launchBrowser } from "../support/browser.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { recordAttempt, recordRun } from "../support/run_rows.ts";
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
    // A tenant name nobody could create, planted straight into a dead-letter stream, as hostile data would be
    // (by the dead-letter step, which moves only a message in its stream: here one in the lane's slot no worker reads).
    const plantedIn = { ...keys.lane("acme"), stream: `${keys.lane("acme").stream}:planted` };
    await deadLetter(
      r.redis,
      plantedIn,
      {
        id: await r.redis.xadd(plantedIn.stream, "*", "job_id", "planted") as string,
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
      // queues.png, the page with its charts drawn from known data, comes from charts_test.ts.
      await browser.screenshot(`${shots}/queues-live.png`);
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
      assert.equal(await browser.eval("document.getElementById('job-task').innerText"), "summarize v1");
      await browser.screenshot(`${shots}/job.png`);
    });

    await t.step("the Tasks page, a task's page and a run's page show planted script as text", async () => {
      const hostile = `</script><img src=x onerror="document.body.dataset.pwned = 'run'">`;
      const schema = { type: "object", properties: { doc: { type: "string" } } };
      await putTaskVersion(db.sql, "acme", "extract", {
        prompt: `Extract ${hostile} {{input.doc}}`,
        input_schema: schema,
      });
      const runId = crypto.randomUUID();
      await recordRun(db.sql, {
        runId,
        tenant: "acme",
        task: "extract",
        version: 1,
        outcome: "done",
        result: { input: { doc: hostile }, output: { fields: [hostile] }, model: "gpt-test" },
      });
      await browser.goto(`${base}/console`);
      await browser.navigateBy(`[...document.querySelectorAll("nav a")].find((a) => a.innerText === "Tasks").click()`);
      await notPwned("the Tasks page");
      await browser.screenshot(`${shots}/tasks.png`);
      await browser.navigateBy(
        `[...document.querySelectorAll("tbody a")].find((a) => a.innerText === "extract").click()`,
      );
      await notPwned("the task page");
      const definition = JSON.parse(await browser.eval<string>("document.querySelector('pre.definition').innerText"));
      assert.equal(definition.prompt, `Extract ${hostile} {{input.doc}}`);
      await browser.screenshot(`${shots}/task.png`);
      await browser.goto(`${base}/console/jobs/${runId}`);
      await notPwned("the run page");
      assert.equal(await browser.eval("document.getElementById('job-task').innerText"), "extract v1");
      assert.deepEqual(JSON.parse(await browser.eval<string>("document.querySelector('pre.input').innerText")), {
        doc: hostile,
      });
      assert.deepEqual(JSON.parse(await browser.eval<string>("document.querySelector('pre.output').innerText")), {
        fields: [hostile],
      });
      assert.equal(await browser.eval("document.querySelectorAll('main script, main img').length"), 0);
      await browser.screenshot(`${shots}/run.png`);
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

/** The text inside `<dd id="ID">`, tags and all. */
function ddOf(body: string, id: string): string | undefined {
  return new RegExp(`<dd id="${id}">([\\s\\S]*?)</dd>`).exec(body)?.[1];
}

/** The cells of each body row of the page's tables, tags stripped. */
function cellsOf(body: string): string[][] {
  return [...body.matchAll(/<tr>([\s\S]*?)<\/tr>/g)].map((tr) =>
    [...tr[1]!.matchAll(/<td>([\s\S]*?)<\/td>/g)].map((td) => td[1]!.replace(/<[^>]*>/g, "").trim())
  ).filter((cells) => cells.length > 0);
}

Deno.test("the Tasks page, a task's versions, and a run's task, input and output, all escaped", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    console: await createConsole({
      redis: r.redis,
      sql: db.sql,
      keys,
      log: silentLogger,
      token: TOKEN,
      maxBodyBytes: 1 << 20,
      auth: { turnMs: 10 },
    }),
  });
  const get = async (path: string) => {
    const res = await handler(new Request(`http://api${path}`, { headers: { authorization: `Bearer ${TOKEN}` } }));
    return { status: res.status, csp: res.headers.get("content-security-policy"), body: await res.text() };
  };
  const HOSTILE = "</script><img src=x onerror=alert(1)>";
  const ESCAPED = "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;";
  /** Nothing planted became markup: the only `<img`, `<script` or `</script>` would be planted ones. */
  const inert = (body: string, where: string) => {
    assert.ok(!/<img|<\/script><img|onerror=alert\(1\)>/.test(body.replaceAll(ESCAPED, "")), where);
    assert.equal(body.match(/<script/g)?.length, 1, `${where}: only the console's own script tag`);
  };
  const input = { type: "object", properties: { doc: { type: "string" } }, required: ["doc"] };
  const labelled = { type: "object", properties: { label: { type: "string" } }, required: ["label"] };
  try {
    await putTaskVersion(db.sql, "acme", "extract", { prompt: "Extract {{input.doc}}", input_schema: input });
    await putTaskVersion(db.sql, "acme", "extract", {
      prompt: `Label this ${HOSTILE}: {{input.doc}}`,
      model: ["gpt-a", "gpt-b"],
      input_schema: input,
      output_schema: labelled,
      max_output_tokens: 1024,
    });
    await putTaskVersion(db.sql, "acme", "classify", { prompt: "{{input.doc}}", model: "gpt-a", input_schema: input });
    // A tenant name nobody could create, planted straight into the table, as hostile data would be.
    await putTaskVersion(db.sql, `<script>alert("tenant")</script>`, "t", { prompt: "x", input_schema: input });

    const extractRun = crypto.randomUUID(), classifyRun = crypto.randomUUID(), failedRun = crypto.randomUUID();
    const summaryJob = crypto.randomUUID(), queuedRun = crypto.randomUUID(), unknownRun = crypto.randomUUID();
    await recordRun(db.sql, {
      runId: extractRun,
      tenant: "acme",
      task: "extract",
      version: 2,
      outcome: "done",
      result: { input: { doc: HOSTILE }, output: { label: HOSTILE }, model: "gpt-b" },
    });
    for (const attempt of [1, 2]) {
      await recordAttempt(db.sql, {
        runId: extractRun,
        tenant: "acme",
        task: "extract",
        version: 2,
        model: "gpt-b",
        attempt,
        outcome: attempt === 1 ? "retry" : "ok",
        status: attempt === 1 ? 503 : 200,
        promptTokens: 50,
        completionTokens: 7,
      });
    }
    await recordRun(db.sql, {
      runId: classifyRun,
      tenant: "acme",
      task: "classify",
      version: 1,
      outcome: "done",
      result: { input: { doc: "a" }, output: `text output ${HOSTILE}`, model: "gpt-a", cached: true },
    });
    await recordRun(db.sql, {
      runId: failedRun,
      tenant: "acme",
      task: "extract",
      version: 1,
      outcome: "failed",
      error: `output invalid at /label ${HOSTILE}`,
    });
    await commitResults(db.sql, [{ jobId: summaryJob, tenant: "acme", summary: "The summary.", notify: "a@b.co" }]);
    // Runs not decided yet: their records in Redis; one has a model attempt naming its task version.
    for (const id of [queuedRun, unknownRun]) {
      // The queued run is a high one: intake names a priority other than normal in the record (markQueued).
      const priority = id === queuedRun ? { priority: "high" } : {};
      await r.redis.hset(keys.lane("acme").job(id), { tenant: "acme", status: "queued", ...priority });
    }
    await recordAttempt(db.sql, { runId: queuedRun, tenant: "acme", task: "classify", version: 1, outcome: "retry" });

    await t.step("the Tasks page lists every tenant's tasks at their latest version, linked", async () => {
      const { status, csp, body } = await get("/console/tasks");
      assert.equal(status, 200);
      assert.match(csp!, /script-src 'self'/, "the console's CSP, as on every page");
      assert.match(body, /<a href="\/console\/tasks">Tasks<\/a>/, "in the navigation");
      assert.match(body, /3 task\(s\)/);
      const rows = cellsOf(body);
      assert.deepEqual(rows.map((row) => [row[0], row[1], row[2], row[3], row[6], row[7]]), [
        [`&lt;script&gt;alert(&quot;tenant&quot;)&lt;/script&gt;`, "t", "1", "1", "(default)", "text"],
        ["acme", "classify", "1", "1", "gpt-a", "text"],
        ["acme", "extract", "2", "2", "gpt-a, gpt-b", "JSON (output schema)"],
      ]);
      assert.ok(rows.every((row) => /^\d{4}-\d\d-\d\dT/.test(row[4]!) && /^\d{4}-\d\d-\d\dT/.test(row[5]!)));
      assert.match(body, /<a href="\/console\/tasks\/acme\/extract">extract<\/a>/);
      assert.match(body, /href="\/console\/tasks\/%3Cscript%3Ealert\(%22tenant%22\)%3C%2Fscript%3E\/t"/);
      inert(body, "the Tasks page");
    });

    await t.step("a task's page shows every version and its definitions as escaped JSON", async () => {
      const { status, body } = await get("/console/tasks/acme/extract");
      assert.equal(status, 200);
      assert.equal(ddOf(body, "task-tenant"), "acme");
      // The versions' table (the usage charts above it have tables of their figures).
      const versions = body.slice(body.indexOf("<h2>Versions</h2>"));
      assert.deepEqual(cellsOf(versions).map((row) => [row[0], row[2], row[3]]), [
        ["2", "gpt-a, gpt-b", "JSON (output schema)"],
        ["1", "(default)", "text"],
      ]);
      const definitions = [...body.matchAll(/<pre class="definition">([\s\S]*?)<\/pre>/g)].map((m) => m[1]!);
      assert.equal(definitions.length, 2, "both versions' definitions");
      assert.ok(definitions[0]!.includes(`&quot;prompt&quot;: &quot;Label this ${ESCAPED}: {{input.doc}}&quot;`));
      assert.ok(definitions[0]!.includes(`\n  &quot;model&quot;: [\n    &quot;gpt-a&quot;,`), "pretty-printed");
      assert.ok(body.indexOf(`id="v2"`) < body.indexOf(`id="v1"`), "newest first");
      inert(body, "the task page");
      const one = await get("/console/tasks/acme/extract?version=1");
      assert.equal(one.status, 200);
      assert.ok(one.body.includes(`id="v1"`) && !one.body.includes(`id="v2"`), "version 1 alone");
      const hostile = await get(`/console/tasks/${encodeURIComponent(`<script>alert("tenant")</script>`)}/t`);
      assert.equal(hostile.status, 200);
      inert(hostile.body, "the hostile tenant's task page");
      for (
        const path of [
          "/console/tasks/acme/nope",
          "/console/tasks/globex/extract",
          "/console/tasks/acme/extract?version=3",
          "/console/tasks/acme/extract?version=x",
        ]
      ) {
        assert.equal((await get(path)).status, 404, path);
      }
    });

    await t.step("a task run's page: its task version, input and output (escaped), model, cache", async () => {
      const { status, body } = await get(`/console/jobs/${extractRun}`);
      assert.equal(status, 200);
      assert.match(body, /<h1>Run<\/h1>/);
      assert.equal(ddOf(body, "job-task"), `<a href="/console/tasks/acme/extract?version=2">extract v2</a>`);
      assert.equal(ddOf(body, "job-status"), "done");
      const pre = (cls: string) => new RegExp(`<pre class="${cls}">([\\s\\S]*?)</pre>`).exec(body)?.[1];
      assert.equal(pre("input"), `{\n  &quot;doc&quot;: &quot;${ESCAPED}&quot;\n}`);
      assert.equal(pre("output"), `{\n  &quot;label&quot;: &quot;${ESCAPED}&quot;\n}`);
      assert.match(body, /<dt>model<\/dt>\s*<dd>gpt-b<\/dd>\s*<dt>cached<\/dt>\s*<dd>no<\/dd>/);
      assert.deepEqual(cellsOf(body).map((row) => row[4]), ["retry", "ok"], "its model attempts");
      assert.ok(!body.includes("<h2>Summary</h2>"));
      inert(body, "the run page");

      const text = await get(`/console/jobs/${classifyRun}`);
      assert.ok(text.body.includes(`<pre class="output">text output ${ESCAPED}</pre>`), "text output as text");
      assert.match(text.body, /<dd>yes: no model call<\/dd>/);
      inert(text.body, "the cached run's page");

      const failed = await get(`/console/jobs/${failedRun}`);
      assert.equal(ddOf(failed.body, "job-status"), "failed");
      assert.match(ddOf(failed.body, "job-task")!, />extract v1</);
      assert.ok(failed.body.includes(`output invalid at /label ${ESCAPED}`), "the failure's reason, escaped");
      assert.ok(!failed.body.includes("<h2>Input</h2>"), "no result for a failed run");
      inert(failed.body, "the failed run's page");
    });

    await t.step("a summary job's page: summarize v1 and its summary, as before", async () => {
      const { status, body } = await get(`/console/jobs/${summaryJob}`);
      assert.equal(status, 200);
      assert.match(body, /<h1>Job<\/h1>/);
      assert.equal(ddOf(body, "job-task"), "summarize v1");
      assert.match(body, /<pre class="summary">The summary\.<\/pre>/);
      assert.ok(!body.includes("<h2>Input</h2>"));
    });

    await t.step("an undecided run: its task version from its model attempts, else not known yet", async () => {
      const queued = await get(`/console/jobs/${queuedRun}?tenant=acme`);
      assert.equal(ddOf(queued.body, "job-status"), "queued");
      assert.equal(ddOf(queued.body, "job-priority"), "high");
      assert.match(
        ddOf(queued.body, "job-task")!,
        /^<a href="\/console\/tasks\/acme\/classify\?version=1">classify v1/,
      );
      const unknown = await get(`/console/jobs/${unknownRun}?tenant=acme`);
      assert.equal(ddOf(unknown.body, "job-task"), "not known yet");
    });

    await t.step("an expired run: expired, when it expired, no model call, its run.expired notification", async () => {
      const expiredRun = crypto.randomUUID();
      const expiresAtMs = Date.parse("2030-01-02T03:04:05.678Z");
      // Its record as intake wrote it (a high run), then decided expired as the worker decides it.
      await r.redis.hset(keys.lane("acme").job(expiredRun), { tenant: "acme", priority: "high" });
      const outcome = await expireRun(db.sql, {
        jobId: expiredRun,
        tenant: "acme",
        task: "extract",
        version: 1,
        notify: "ops@example.com",
        acceptedMs: expiresAtMs - 2_000,
      }, expiresAtMs);
      assert.equal(outcome, "expired");
      const { status, body } = await get(`/console/jobs/${expiredRun}`);
      assert.equal(status, 200);
      assert.match(body, /<h1>Run<\/h1>/);
      assert.equal(ddOf(body, "job-status"), "expired");
      assert.equal(ddOf(body, "job-expires-at"), "2030-01-02T03:04:05.678Z");
      assert.match(body, /<dt>expired at<\/dt>\s*<dd id="job-expires-at">/);
      assert.match(ddOf(body, "job-task")!, /^<a href="\/console\/tasks\/acme\/extract\?version=1">extract v1/);
      assert.match(body, /<dd>email\.run_finished: pending<\/dd>/, "its notification");
      assert.ok(body.includes("No model call yet."), "no model attempt");
      assert.ok(!body.includes("<h2>Input</h2>") && !body.includes("<h2>Output</h2>"), "no result");
      // Only an expired run says when it expired.
      for (const other of [extractRun, failedRun, queuedRun]) {
        assert.equal(ddOf((await get(`/console/jobs/${other}?tenant=acme`)).body, "job-expires-at"), undefined);
      }
      inert(body, "the expired run's page");
    });
  } finally {
    await r.close();
    await db.close();
  }
});
