/**
 * Who gets into the console: every check of ADMIN_TOKEN (a `Bearer` header
 * on any /console URL, or the sign-in form) takes a turn held in Redis, so
 * guesses cost the same time however they are sent and from however many API
 * processes; each failed check is logged; signing out ends the session on
 * the server. Short turns (`turnMs`) keep the test fast; the service uses
 * 250 ms.
 */
import assert from "node:assert/strict";
import { createConsole } from "../../src/console/console.ts";
import { createLogger } from "../../src/log/logger.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { apiHandler } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, recordingLogger } from "../_support.ts";

const TOKEN = "console-auth-test-admin-token-0123456789";
const TURN_MS = 10;

Deno.test("console sign-in and the admin-token check", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const rec = recordingLogger();
  const log = createLogger({ write: rec.write });
  /** One API process's handler with its console; two of them share Redis as two processes would. */
  const api = async (auth: { turnMs?: number; maxWaitMs?: number } = {}) =>
    apiHandler({ redis: r.redis, sql: db.sql, keys, log }, {
      authMode: "api-key",
      console: await createConsole({
        redis: r.redis,
        sql: db.sql,
        keys,
        log,
        token: TOKEN,
        maxBodyBytes: 64 * 1024,
        auth: { turnMs: TURN_MS, ...auth },
      }),
    });
  const handler = await api();
  const bearer = (token: string, h = handler) =>
    h(new Request("http://api/console/dead-letters", { headers: { authorization: `Bearer ${token}` } }));
  const form = (token: string, h = handler) =>
    h(new Request("http://api/console/login", { method: "POST", body: new URLSearchParams({ token }) }));
  const failures = (via: string) =>
    rec.lines.filter((l) => l.event === "console_auth_failed" && l.via === via && l.reason === "wrong_token");
  /** Sends guesses 0..n-1, one after another or all at once; @returns the wall time in ms. */
  const timed = async (n: number, guess: (i: number) => Promise<Response>, parallel = false) => {
    const started = performance.now();
    const answer = async (i: number) => {
      const res = await guess(i);
      assert.notEqual(res.status, 200, `guess ${i} was let in`);
      await res.body?.cancel();
    };
    if (parallel) await Promise.all(Array.from({ length: n }, (_, i) => answer(i)));
    else for (let i = 0; i < n; i++) await answer(i);
    return performance.now() - started;
  };

  try {
    await t.step("300 wrong Bearer guesses take as long as 300 form guesses, and each is logged", async () => {
      rec.lines.length = 0;
      const bearerMs = await timed(300, (i) => bearer(`wrong-bearer-guess-${i}-abcdefgh`));
      const formMs = await timed(300, (i) => form(`wrong-form-guess-${i}-abcdefgh`));
      console.log(`300 Bearer guesses: ${Math.round(bearerMs)} ms; 300 form guesses: ${Math.round(formMs)} ms`);
      for (const [what, ms] of [["Bearer", bearerMs], ["form", formMs]] as const) {
        assert.ok(ms >= 300 * TURN_MS * 0.95, `${what} guesses took ${Math.round(ms)} ms, under 300 turns`);
      }
      assert.equal(failures("bearer").length, 300, "every Bearer guess logged");
      assert.equal(failures("form").length, 300, "every form guess logged");
      const text = JSON.stringify(rec.lines);
      assert.ok(!text.includes("guess-"), "no log line carries a guessed token");
      assert.ok(!text.includes(TOKEN));
    });

    await t.step(
      "200 parallel guesses, across two API processes, are slowed as much as 200 sequential ones",
      async () => {
        // Longer turns here, so that each request's own cost (a few ms, paid in sequence) matters little.
        const turnMs = 25;
        const [one, two] = [await api({ turnMs }), await api({ turnMs })];
        const sequentialMs = await timed(200, (i) => form(`sequential-guess-${i}-abcdefgh`, one));
        const parallelMs = await timed(
          200,
          (i) => (i % 2 ? form(`parallel-guess-${i}-abcdefgh`, one) : bearer(`parallel-guess-${i}-abcdefgh`, two)),
          true,
        );
        console.log(
          `200 sequential guesses: ${Math.round(sequentialMs)} ms; 200 parallel: ${Math.round(parallelMs)} ms`,
        );
        assert.ok(sequentialMs >= 200 * turnMs * 0.95, `sequential guesses took ${Math.round(sequentialMs)} ms`);
        assert.ok(parallelMs >= 200 * turnMs * 0.95, `parallel guesses took ${Math.round(parallelMs)} ms`);
        assert.ok(parallelMs >= sequentialMs * 0.8, "parallel guessing gains (almost) nothing");
      },
    );

    await t.step(
      "the right token waits for no one when nobody guesses, and for its turn when someone does",
      async () => {
        let started = performance.now();
        const res = await bearer(TOKEN);
        assert.equal(res.status, 200);
        await res.body?.cancel();
        assert.ok(performance.now() - started < 5 * TURN_MS, "answered at once");
        const flood = timed(30, (i) => form(`flood-guess-${i}-abcdefgh`), true);
        await new Promise((resolve) => setTimeout(resolve, 5));
        started = performance.now();
        const during = await bearer(TOKEN);
        assert.equal(during.status, 200);
        await during.body?.cancel();
        assert.ok(performance.now() - started >= 20 * TURN_MS, "behind the guesses already queued");
        await flood;
      },
    );

    await t.step("a guess whose turn is more than maxWaitMs away is refused at once with 429, unchecked", async () => {
      const strict = await api({ maxWaitMs: 100 });
      rec.lines.length = 0;
      const answers = await Promise.all(
        Array.from({ length: 40 }, (_, i) => form(`queued-guess-${i}-abcdefgh`, strict)),
      );
      const statuses = answers.map((a) => a.status);
      await Promise.all(answers.map((a) => a.body?.cancel()));
      const refused = answers.filter((a) => a.status === 429);
      assert.ok(refused.length >= 20, `statuses: ${statuses.join(",")}`);
      assert.ok(refused.every((a) => Number(a.headers.get("retry-after")) >= 1));
      const throttled = rec.lines.filter((l) => l.event === "console_auth_failed" && l.reason === "throttled");
      assert.equal(throttled.length, refused.length, "each refused guess is logged");
      assert.equal(failures("form").length, 40 - refused.length, "the others were checked");
      await new Promise((resolve) => setTimeout(resolve, 40 * TURN_MS));
    });

    await t.step("signing out ends the session: the old cookie then gets the login page", async () => {
      const signIn = await form(TOKEN);
      assert.equal(signIn.status, 303);
      const cookie = signIn.headers.get("set-cookie")!.split(";")[0]!;
      assert.ok(!cookie.includes(TOKEN), "the cookie is not the token");
      const page = await handler(new Request("http://api/console", { headers: { cookie } }));
      assert.equal(page.status, 200);
      const csrf = /name="csrf" value="([^"]+)"/.exec(await page.text())![1]!;
      const sessions = await r.redis.keys(`${keys.prefix}:*session*`);
      assert.equal(sessions.length, 1, "the session is held in Redis");
      const ttl = await r.redis.ttl(sessions[0]!);
      assert.ok(ttl > 12 * 3600 - 60 && ttl <= 12 * 3600, `a session lasts 12 h (TTL ${ttl} s)`);
      const out = await handler(
        new Request("http://api/console/logout", {
          method: "POST",
          headers: { cookie },
          body: new URLSearchParams({ csrf }),
        }),
      );
      assert.equal(out.status, 303);
      assert.match(out.headers.get("set-cookie")!, /Max-Age=0/);
      const after = await handler(new Request("http://api/console", { headers: { cookie } }));
      assert.equal(after.status, 303);
      assert.equal(after.headers.get("location"), "/console/login");
      assert.deepEqual(await r.redis.keys(`${keys.prefix}:*session*`), [], "nothing left of the session");
      // A cookie of the right shape whose signature does not match is no session either.
      const forged = cookie.replace(/\.[^.]+$/, ".AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA");
      const refused = await handler(new Request("http://api/console", { headers: { cookie: forged } }));
      assert.equal(refused.status, 303);
    });

    await t.step("a failed check is logged with where it came from", async () => {
      const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, handler);
      try {
        rec.lines.length = 0;
        const res = await fetch(`http://127.0.0.1:${server.addr.port}/console`, {
          headers: { authorization: "Bearer not-the-token-not-the-token", "x-forwarded-for": "203.0.113.7" },
        });
        assert.equal(res.status, 401);
        assert.match(res.headers.get("www-authenticate") ?? "", /^Bearer/);
        await res.body?.cancel();
        const [line] = failures("bearer");
        assert.equal(line?.address, "127.0.0.1");
        assert.equal(line?.forwarded_for, "203.0.113.7");
        assert.equal(line?.level, "warn");
      } finally {
        await server.shutdown();
      }
    });
  } finally {
    await r.close();
    await db.close();
  }
});
