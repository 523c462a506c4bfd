import assert from "node:assert/strict";
import { APIConnectionError, BadRequestError, InternalServerError, RateLimitError } from "openai";
import { failureKindOf, isRetryable, reasonOf, retryAfterMs } from "../../src/retry/classify.ts";
import { Deadline } from "../../src/retry/deadline.ts";
import {
  AttemptTimeout,
  ConnectionError,
  DeadlineExceeded,
  GateRefused,
  GateUnavailable,
  PermissionDenied,
  UpstreamHttpError,
} from "../../src/retry/errors.ts";
import { type AttemptReport, backoffMs, callWithRetries } from "../../src/retry/retry_policy.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { fromOpenAiError } from "../../src/llm/openai_errors.ts";
import { errorBody, startFakeModel } from "../support/fake_model_server.ts";
import { fakeClock, seededRandom } from "../_support.ts";

const upstream = (status: number, headers: Record<string, string> = {}, body = "") =>
  new UpstreamHttpError(status, new Headers(headers), body);

Deno.test("isRetryable() retries timeouts, connection errors, 408, 409, 429 and 5xx, nothing else", () => {
  for (const s of [408, 409, 429, 500, 502, 503, 504, 599]) assert.equal(isRetryable(upstream(s)), true, `status ${s}`);
  for (const s of [400, 401, 403, 404, 413, 422]) assert.equal(isRetryable(upstream(s)), false, `status ${s}`);
  assert.equal(isRetryable(new AttemptTimeout("slow")), true);
  assert.equal(isRetryable(new ConnectionError("refused")), true);
  assert.equal(isRetryable(new DOMException("t", "TimeoutError")), true);
  assert.equal(isRetryable(new DeadlineExceeded("spent")), false);
  assert.equal(isRetryable(new TypeError("a bug")), false);
  assert.equal(isRetryable(new Error("unknown")), false);
  assert.equal(
    isRetryable(new UpstreamHttpError(429, new Headers(), "quota", { refusal: "quota_exhausted" })),
    false,
  );
  const sdk429 = fromOpenAiError(
    new RateLimitError(429, errorBody("slow down", "requests"), "slow down", new Headers()),
  );
  assert.equal(isRetryable(sdk429), true);
  const quota = fromOpenAiError(
    new RateLimitError(
      429,
      errorBody("You exceeded your current quota", "insufficient_quota", "insufficient_quota").error,
      "quota",
      new Headers(),
    ),
  );
  assert.equal(isRetryable(quota), false);
  assert.equal(isRetryable(fromOpenAiError(new BadRequestError(400, undefined, "bad", new Headers()))), false);
  assert.equal(isRetryable(fromOpenAiError(new InternalServerError(503, undefined, "down", new Headers()))), true);
});

Deno.test("retryAfterMs() reads retry-after-ms, seconds and HTTP dates", () => {
  const now = Date.parse("2026-11-30T10:00:00Z");
  assert.equal(retryAfterMs(upstream(429, { "retry-after-ms": "250" }), now), 250);
  assert.equal(retryAfterMs(upstream(429, { "retry-after": "3" }), now), 3000);
  assert.equal(retryAfterMs(upstream(503, { "retry-after": "Mon, 30 Nov 2026 10:00:05 GMT" }), now), 5000);
  assert.equal(retryAfterMs(upstream(503, { "retry-after": "soon" }), now), undefined);
  assert.equal(retryAfterMs(upstream(503), now), undefined);
});

Deno.test("backoffMs() stays within full-jitter bounds for a seeded random source, and caps Retry-After", () => {
  const random = seededRandom(42);
  const seen: number[] = [];
  for (let attempt = 1; attempt <= 8; attempt++) {
    for (let i = 0; i < 200; i++) {
      const wait = backoffMs(attempt, new Error("x"), { baseMs: 100, capMs: 2000, random, epochNow: 0 });
      const bound = Math.min(2000, 100 * 2 ** attempt);
      assert.ok(wait >= 0 && wait < bound, `attempt ${attempt}: ${wait} in [0, ${bound})`);
      seen.push(wait / bound);
    }
  }
  // Full jitter spreads waits over the whole range, not near the top.
  assert.ok(Math.min(...seen) < 0.05 && Math.max(...seen) > 0.95);
  const capped = backoffMs(1, upstream(429, { "retry-after": "60" }), {
    baseMs: 100,
    capMs: 2000,
    random,
    epochNow: 0,
  });
  assert.equal(capped, 2000);
});

Deno.test("callWithRetries() with the real SDK", async (t) => {
  await t.step(
    "a 429 with Retry-After is retried after exactly that wait and succeeds on the second request",
    async () => {
      const model = startFakeModel((n) =>
        n === 1
          ? { kind: "status", status: 429, headers: { "retry-after": "2" }, body: errorBody("slow down", "requests") }
          : { kind: "ok" }
      );
      try {
        const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
        const clock = fakeClock();
        const reports: AttemptReport[] = [];
        const text = await callWithRetries((signal) => llm.complete("Revenue rose. Costs fell.", { signal }), {
          deadline: Deadline.after(60_000, clock),
          perCallTimeoutMs: 20_000,
          maxAttempts: 4,
          capMs: 8_000,
          clock,
          onAttempt: (r) => reports.push(r),
        });
        assert.equal(text.text, "Revenue rose. Costs fell.");
        assert.equal(model.requests, 2);
        assert.deepEqual(clock.sleeps, [2000]);
        assert.deepEqual(reports.map((r) => [r.outcome, r.reason]), [["retry", "http_429"], ["ok", undefined]]);
      } finally {
        await model.close();
      }
    },
  );

  await t.step("a 400 raises an UpstreamHttpError 400 and is not retried: the server sees one request", async () => {
    const model = startFakeModel(() => ({
      kind: "status",
      status: 400,
      body: errorBody("too long", "invalid_request_error"),
    }));
    try {
      const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
      const clock = fakeClock();
      await assert.rejects(
        () =>
          callWithRetries((signal) => llm.complete("x", { signal }), {
            deadline: Deadline.after(60_000, clock),
            perCallTimeoutMs: 20_000,
            maxAttempts: 4,
            clock,
          }),
        (e: unknown) => e instanceof UpstreamHttpError && e.status === 400 && e.cause instanceof BadRequestError,
      );
      assert.equal(model.requests, 1);
      assert.deepEqual(clock.sleeps, []);
    } finally {
      await model.close();
    }
  });

  await t.step("insufficient_quota is permanent: one request, no wait", async () => {
    const model = startFakeModel(() => ({
      kind: "status",
      status: 429,
      headers: { "retry-after": "1" },
      body: errorBody("You exceeded your current quota", "insufficient_quota", "insufficient_quota"),
    }));
    try {
      const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
      const clock = fakeClock();
      const error = await callWithRetries((signal) => llm.complete("x", { signal }), {
        deadline: Deadline.after(60_000, clock),
        perCallTimeoutMs: 20_000,
        maxAttempts: 4,
        clock,
      }).catch((e) => e);
      assert.ok(error instanceof UpstreamHttpError && error.status === 429 && error.cause instanceof RateLimitError);
      assert.equal(isRetryable(error), false);
      assert.equal(model.requests, 1);
    } finally {
      await model.close();
    }
  });

  await t.step("a 503 storm stops after maxAttempts requests and rethrows a retryable error", async () => {
    const model = startFakeModel(() => ({ kind: "status", status: 503 }));
    try {
      const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
      const clock = fakeClock();
      const error = await callWithRetries((signal) => llm.complete("x", { signal }), {
        deadline: Deadline.after(60_000, clock),
        perCallTimeoutMs: 20_000,
        maxAttempts: 4,
        baseMs: 100,
        clock,
        random: seededRandom(1),
      }).catch((e) => e);
      assert.ok(
        error instanceof UpstreamHttpError && error.status === 503 && error.cause instanceof InternalServerError,
      );
      assert.equal(isRetryable(error), true);
      assert.equal(model.requests, 4);
      assert.equal(clock.sleeps.length, 3);
    } finally {
      await model.close();
    }
  });

  await t.step(
    "a model that always hangs: per-call 0.2 s, deadline 0.5 s, fails in under 0.6 s after at most 3 calls",
    async () => {
      const model = startFakeModel(() => ({ kind: "hang" }));
      try {
        const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
        const started = performance.now();
        const error = await callWithRetries((signal) => llm.complete("x", { signal }), {
          deadline: Deadline.after(500),
          perCallTimeoutMs: 200,
          maxAttempts: 10,
          baseMs: 50,
          capMs: 200,
        }).catch((e) => e);
        const elapsed = performance.now() - started;
        assert.ok(error instanceof DeadlineExceeded, `got ${error}`);
        assert.ok(error.cause instanceof AttemptTimeout);
        assert.ok(elapsed < 600, `failed after ${elapsed.toFixed(0)} ms`);
        assert.ok(model.requests >= 1 && model.requests <= 3, `${model.requests} calls`);
      } finally {
        await model.close();
      }
    },
  );

  await t.step("a dripping response is cut by the wall-clock cap", async () => {
    const model = startFakeModel(() => ({ kind: "drip", intervalMs: 50 }));
    try {
      const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
      const started = performance.now();
      const error = await callWithRetries((signal) => llm.complete("x", { signal }), {
        deadline: Deadline.after(10_000),
        perCallTimeoutMs: 300,
        maxAttempts: 1,
      }).catch((e) => e);
      const elapsed = performance.now() - started;
      assert.ok(error instanceof AttemptTimeout, `got ${error}`);
      assert.ok(isRetryable(error));
      assert.ok(elapsed >= 290 && elapsed < 1500, `cut after ${elapsed.toFixed(0)} ms`);
      assert.equal(model.requests, 1);
    } finally {
      await model.close();
    }
  });
});

Deno.test("an attempt that runs out of time is an AttemptTimeout, with or without a stop signal beside it", async () => {
  // A call that rejects the moment its signal aborts, with the signal's reason: the attempt's own timeout must
  // still be what the caller sees (the attempt log's error class, the dead letter's reason).
  const call = (signal: AbortSignal) =>
    new Promise<never>((_, reject) => signal.addEventListener("abort", () => reject(signal.reason)));
  for (const signal of [undefined, new AbortController().signal]) {
    const error = await callWithRetries(call, {
      deadline: Deadline.after(10_000),
      perCallTimeoutMs: 20,
      maxAttempts: 1,
      signal,
    }).catch((e) => e);
    assert.ok(error instanceof AttemptTimeout, `${signal ? "with" : "without"} a stop signal: got ${error}`);
  }
});

Deno.test("callWithRetries() stops before a sleep that would leave less than one useful attempt", async () => {
  const clock = fakeClock();
  let calls = 0;
  const error = await callWithRetries(() => {
    calls++;
    clock.advance(4_000);
    return Promise.reject(upstream(503, { "retry-after": "5" }));
  }, {
    deadline: Deadline.after(10_000, clock),
    perCallTimeoutMs: 5_000,
    maxAttempts: 10,
    minAttemptMs: 1_000,
    capMs: 8_000,
    clock,
  }).catch((e) => e);
  // t=4 s after the first call; waiting 5 s leaves 1 s: still one useful attempt.
  // t=13 s would be past the budget, so the second failure stops before sleeping.
  assert.ok(error instanceof DeadlineExceeded);
  assert.equal(calls, 2);
  assert.deepEqual(clock.sleeps, [5_000]);
});

Deno.test("callWithRetries() with a gate: an absorbed failure costs neither an attempt nor budget", async () => {
  const clock = fakeClock();
  const outcomes: string[] = [];
  let calls = 0;
  const gate = {
    acquire() {
      clock.advance(30_000); // the provider's outage: a long wait for the permit
      return Promise.resolve({
        permit: {
          waitedMs: 30_000,
          settle(o: { value?: unknown; error?: unknown }) {
            outcomes.push(o.error ? "error" : "ok");
            return Promise.resolve(o.error !== undefined && calls <= 5); // the first five failures are the provider's
          },
        },
      });
    },
  };
  const reports: AttemptReport[] = [];
  const result = await callWithRetries(() => {
    calls++;
    clock.advance(2_000); // each failing call takes 2 s of the job's 10 s budget
    return calls <= 6 ? Promise.reject(upstream(503)) : Promise.resolve("done");
  }, {
    gate,
    deadline: Deadline.after(10_000, clock),
    perCallTimeoutMs: 5_000,
    maxAttempts: 2,
    baseMs: 1,
    clock,
    random: () => 0,
    onAttempt: (r) => reports.push(r),
  });
  assert.equal(result, "done");
  assert.equal(calls, 7);
  assert.deepEqual(reports.map((r) => `${r.attempt}:${r.outcome}`), [
    "1:paused",
    "1:paused",
    "1:paused",
    "1:paused",
    "1:paused",
    "1:retry",
    "2:ok",
  ]);
  assert.equal(outcomes.length, 7, "every attempt settled its permit");
});

Deno.test("callWithRetries() asks the gate before every attempt and calls each with its own grant, settled with its own outcome", async () => {
  const clock = fakeClock();
  const settled: string[] = [];
  const endpoints = ["a", "b"];
  let grants = 0;
  const gate = {
    acquire() {
      // A later attempt may go elsewhere: the grant, not the caller, names where the call goes.
      const endpoint = endpoints[Math.min(grants++, endpoints.length - 1)]!;
      return Promise.resolve({
        endpoint,
        permit: {
          waitedMs: 0,
          settle(o: { value?: unknown; error?: unknown }) {
            settled.push(`${endpoint}:${o.error ? "error" : o.value}`);
            return Promise.resolve(false);
          },
        },
      });
    },
  };
  const called: string[] = [];
  const result = await callWithRetries((_signal, { endpoint }) => {
    called.push(endpoint);
    return endpoint === "a" ? Promise.reject(upstream(503)) : Promise.resolve(`from ${endpoint}`);
  }, {
    gate,
    deadline: Deadline.after(10_000, clock),
    perCallTimeoutMs: 5_000,
    maxAttempts: 3,
    baseMs: 1,
    clock,
    random: () => 0,
  });
  assert.equal(result, "from b");
  assert.equal(grants, 2);
  assert.deepEqual(called, ["a", "b"]);
  assert.deepEqual(settled, ["a:error", "b:from b"]);
});

Deno.test("callWithRetries() leaves the job transient when the gate cannot settle, and never calls without a permit", async () => {
  const clock = fakeClock();
  let calls = 0;
  const error = await callWithRetries(() => {
    calls++;
    return Promise.reject(new UpstreamHttpError(429, new Headers(), "quota", { refusal: "quota_exhausted" }));
  }, {
    gate: {
      acquire: () =>
        Promise.resolve({
          permit: { waitedMs: 0, settle: () => Promise.reject(new Error("Connection is closed.")) },
        }),
    },
    deadline: Deadline.after(10_000, clock),
    perCallTimeoutMs: 5_000,
    maxAttempts: 3,
    clock,
  }).catch((e) => e);
  assert.ok(error instanceof GateUnavailable, "not the permanent quota error");
  assert.equal(calls, 1);
  const refused = await callWithRetries(() => {
    calls++;
    return Promise.resolve("never");
  }, {
    gate: { acquire: () => Promise.reject(new GateRefused("too large")) },
    deadline: Deadline.after(10_000, clock),
    perCallTimeoutMs: 5_000,
    maxAttempts: 3,
    clock,
  }).catch((e) => e);
  assert.ok(refused instanceof GateRefused);
  assert.equal(calls, 1);
});

Deno.test("failureKindOf() tells the provider's trouble from one document's", () => {
  const tooLarge = fromOpenAiError(
    new RateLimitError(
      429,
      errorBody("Request too large for gpt-4.1-mini on tokens per min (TPM): Limit 30000, Requested 45000.", "tokens")
        .error,
      "Request too large for gpt-4.1-mini on tokens per min (TPM): Limit 30000, Requested 45000.",
      new Headers(),
    ),
  );
  assert.equal(failureKindOf(tooLarge), "request");
  assert.equal(isRetryable(tooLarge), false, "waiting will not shrink the document");
  assert.equal(
    failureKindOf(
      fromOpenAiError(new RateLimitError(429, errorBody("slow down", "requests").error, "slow", new Headers())),
    ),
    "rate_limited",
  );
  assert.equal(failureKindOf(upstream(503)), "provider");
  assert.equal(failureKindOf(new AttemptTimeout("slow")), "provider");
  assert.equal(failureKindOf(new ConnectionError("refused")), "provider");
  assert.equal(failureKindOf(upstream(400)), "request");
  assert.equal(
    failureKindOf(
      new BadRequestError(
        400,
        errorBody("context_length_exceeded", "invalid_request_error").error,
        "too long",
        new Headers(),
      ),
    ),
    "request",
  );
});

Deno.test("a permission denial (NotCapable) is a named, permanent error, not a connection error retried for ever", () => {
  const denied = Object.assign(new Error('Requires net access to "mail.internal:443"'), { name: "NotCapable" });
  const sdk = fromOpenAiError(new APIConnectionError({ message: "Connection error.", cause: denied }));
  assert.ok(sdk instanceof PermissionDenied);
  assert.match((sdk as Error).message, /OPENAI_BASE_URL/);
  assert.equal(isRetryable(sdk), false);
  assert.equal(reasonOf(sdk), "permission_denied");
  const plain = fromOpenAiError(
    new APIConnectionError({ message: "Connection error.", cause: new TypeError("reset") }),
  );
  assert.ok(plain instanceof ConnectionError);
  assert.equal(isRetryable(plain), true);
});

Deno.test("callWithRetries() stopped while its permit is granted never calls and records nothing; stopped in flight, it records the call before its settlement", async () => {
  const clock = fakeClock();
  const stop = new AbortController();
  const settled: unknown[] = [];
  const reports: AttemptReport[] = [];
  let calls = 0;
  // The stop lands while the gate grants the permit (say, a budget's reservation still under way).
  const error = await callWithRetries(() => {
    calls++;
    return Promise.resolve("never");
  }, {
    gate: {
      acquire: () => {
        stop.abort(new Error("stopping"));
        return Promise.resolve({
          permit: { waitedMs: 0, settle: (o: unknown) => (settled.push(o), Promise.resolve(false)) },
        });
      },
    },
    deadline: Deadline.after(10_000, clock),
    perCallTimeoutMs: 5_000,
    maxAttempts: 3,
    clock,
    signal: stop.signal,
    onAttempt: (r) => reports.push(r),
  }).catch((e) => e);
  assert.equal((error as Error).message, "stopping");
  assert.equal(calls, 0, "the call never went out");
  assert.deepEqual(reports, [], "no attempt to record");
  assert.deepEqual(settled, [{ aborted: true, notSent: true }], "the permit went back as never used");

  // Stopped while the call runs, with a settlement that does not end (a Redis that does not answer): the attempt
  // is recorded all the same, before the settlement.
  const inFlight = new AbortController();
  const recorded: AttemptReport[] = [];
  void callWithRetries((signal) =>
    new Promise<string>((_, reject) => {
      signal.addEventListener("abort", () => reject(signal.reason), { once: true });
      inFlight.abort(new Error("stopping"));
    }), {
    gate: {
      acquire: () => Promise.resolve({ permit: { waitedMs: 0, settle: () => new Promise<boolean>(() => {}) } }),
    },
    deadline: Deadline.after(10_000, clock),
    perCallTimeoutMs: 5_000,
    maxAttempts: 3,
    clock,
    signal: inFlight.signal,
    onAttempt: (r) => recorded.push(r),
  }).catch(() => {});
  for (let i = 0; i < 20 && recorded.length === 0; i++) await Promise.resolve();
  assert.deepEqual(recorded.map((r) => `${r.attempt}:${r.outcome}`), ["1:aborted"]);
  assert.ok(recorded[0]!.started_at_ms !== undefined, "a call that started");
});
