import assert from "node:assert/strict";
import { Deadline } from "../../src/retry/deadline.ts";
import { DeadlineExceeded } from "../../src/retry/errors.ts";
import type { SchemaViolation } from "../../src/tasks/json_schema.ts";
import {
  validateWithin,
  VALIDATION_RETRY,
  ValidationBusy,
  ValidationTimeout,
  ValidationTooCostly,
} from "../../src/tasks/validator.ts";
import { fakeClock } from "../_support.ts";

const REQUEST = { key: "acme/t/1/output", schema: { type: "object" }, instance: {} };

/** A validator whose first `timeouts` validations time out (each after 250 ms on `clock`), then find it valid. */
function flaky(clock: ReturnType<typeof fakeClock>, timeouts: number) {
  const validator = {
    calls: 0,
    validate(): Promise<SchemaViolation[]> {
      validator.calls++;
      if (validator.calls > timeouts) return Promise.resolve([]);
      clock.advance(250);
      return Promise.reject(new ValidationTimeout(250));
    },
  };
  return validator;
}

Deno.test("validateWithin() asks again after a timeout and returns the answer that comes", async () => {
  const clock = fakeClock();
  const validator = flaky(clock, 3);
  const violations = await validateWithin(validator.validate, REQUEST, {
    deadline: Deadline.after(5_000, clock),
    clock,
    random: () => 1,
  });
  assert.deepEqual(violations, []);
  assert.equal(validator.calls, 4);
  // Full jitter at its top: 50, 100, 200 ms.
  assert.deepEqual(clock.sleeps, [0, 1, 2].map((n) => VALIDATION_RETRY.baseMs * 2 ** n));
});

Deno.test("validateWithin() gives up with DeadlineExceeded when no try fits in the deadline any more", async () => {
  const clock = fakeClock();
  const validator = flaky(clock, Number.POSITIVE_INFINITY);
  const error = await validateWithin(validator.validate, REQUEST, {
    deadline: Deadline.after(2_000, clock),
    clock,
    random: () => 1,
  }).then(() => undefined, (e) => e);
  assert.ok(error instanceof DeadlineExceeded, String(error));
  assert.ok(error.cause instanceof ValidationTimeout);
  // Tried while the wait and one more 250 ms try still fitted, and never past the deadline.
  assert.ok(clock.now() <= 2_000, `ended at ${clock.now()} ms`);
  assert.ok(validator.calls >= 4, `${validator.calls} tries`);
});

Deno.test("validateWithin() reports a real verdict, and any other error, at once", async () => {
  const clock = fakeClock();
  const invalid: SchemaViolation[] = [{ pointer: "/a", message: "wrong" }];
  const violations = await validateWithin(() => Promise.resolve(invalid), REQUEST, {
    deadline: Deadline.after(5_000, clock),
    clock,
  });
  assert.deepEqual(violations, invalid);
  let calls = 0;
  await assert.rejects(
    validateWithin(
      () => {
        calls++;
        return Promise.reject(new Error("The schema validation Worker failed"));
      },
      REQUEST,
      { deadline: Deadline.after(5_000, clock), clock },
    ),
    /Worker failed/,
  );
  assert.equal(calls, 1);
  assert.deepEqual(clock.sleeps, []);
});

Deno.test("validateWithin() waits out validators that are busy, as a timeout, and reports too costly at once", async () => {
  const clock = fakeClock();
  let calls = 0;
  const busyTwice = (): Promise<SchemaViolation[]> =>
    ++calls <= 2 ? Promise.reject(new ValidationBusy("8 of this tenant's; at most 8")) : Promise.resolve([]);
  assert.deepEqual(
    await validateWithin(busyTwice, REQUEST, { deadline: Deadline.after(5_000, clock), clock, random: () => 1 }),
    [],
  );
  assert.equal(calls, 3);
  assert.deepEqual(clock.sleeps, [VALIDATION_RETRY.baseMs, VALIDATION_RETRY.baseMs * 2]);

  const alwaysBusy = () => Promise.reject(new ValidationBusy("64 in all; at most 64"));
  const error = await validateWithin(alwaysBusy, REQUEST, {
    deadline: Deadline.after(1_000, clock),
    clock,
    random: () => 1,
  }).then(() => undefined, (e) => e);
  assert.ok(error instanceof DeadlineExceeded, String(error));
  assert.ok(error.cause instanceof ValidationBusy);
  assert.match(error.message, /found the validators busy/);

  // A verdict that would be the same on every try: not asked again.
  let costly = 0;
  await assert.rejects(
    validateWithin(
      () => {
        costly++;
        return Promise.reject(new ValidationTooCostly(1_000_000));
      },
      REQUEST,
      { deadline: Deadline.after(5_000, clock), clock },
    ),
    ValidationTooCostly,
  );
  assert.equal(costly, 1);
});

Deno.test("validateWithin() stops waiting for a Worker at the deadline: a starved pool does not hold the delivery", async () => {
  const clock = fakeClock();
  let seen: AbortSignal | undefined;
  // A validation queued behind busy Workers: it settles only when its caller gives up waiting.
  const queued = (_k: string, _s: unknown, _i: unknown, signal: AbortSignal) =>
    new Promise<SchemaViolation[]>((_, reject) => {
      seen = signal;
      signal.addEventListener("abort", () => reject(signal.reason), { once: true });
    });
  const started = performance.now();
  const error = await validateWithin(queued, REQUEST, { deadline: Deadline.after(100, clock), clock })
    .then(() => undefined, (e) => e);
  assert.ok(error instanceof DeadlineExceeded, String(error));
  assert.match(error.message, /waited for a validator past the deadline/);
  assert.equal(seen?.aborted, true);
  assert.ok(performance.now() - started < 5_000);
});
