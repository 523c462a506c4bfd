/**
 * The direct checks and loops on the request and job paths answer exactly as the general code they stand in
 * for: zod's schemas, the recursive canonical JSON, the rendered template.
 */
import assert from "node:assert/strict";
import { canonicalJson } from "../../src/idempotency/fingerprint.ts";
import { JobFields, jobFields } from "../../src/runs/run_load.ts";
import { PermanentJobError } from "../../src/queue/errors.ts";
import { parseRunRequest, RunRequest } from "../../src/runs/run_schemas.ts";
import { renderedChars, renderTemplate } from "../../src/tasks/definition.ts";
import { seededRandom } from "../_support.ts";
import { assertParsedAlike, NOTIFY_CASES, randomAddresses } from "../runs/_notify_cases.ts";

/** The canonical JSON as it was first written (entries, filter, sort, map, join): the reference. */
function canonicalReference(value: unknown): string {
  if (Array.isArray(value)) return `[${value.map(canonicalReference).join(",")}]`;
  if (value !== null && typeof value === "object") {
    const entries = Object.entries(value as Record<string, unknown>)
      .filter(([, v]) => v !== undefined)
      .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
    return `{${entries.map(([k, v]) => `${JSON.stringify(k)}:${canonicalReference(v)}`).join(",")}}`;
  }
  return JSON.stringify(value);
}

/** A random JSON-like value (undefined entries and odd keys included), at most `depth` levels deep. */
function randomValue(random: () => number, depth: number): unknown {
  const pick = Math.floor(random() * (depth > 0 ? 9 : 6));
  const keys = ["a", "b", "B", "é", "a b", '"', "10", "2", "__proto__", "\ud83d\ude00", ""];
  switch (pick) {
    case 0:
      return null;
    case 1:
      return random() < 0.5;
    case 2:
      return Math.floor(random() * 2000) - 1000 + (random() < 0.3 ? 0.5 : 0);
    case 3:
      return keys[Math.floor(random() * keys.length)]! + "\n\u0001x";
    case 4:
      return undefined;
    case 5:
      return "";
    case 6:
    case 7: {
      const object: Record<string, unknown> = {};
      for (let i = Math.floor(random() * 5); i > 0; i--) {
        Object.defineProperty(object, keys[Math.floor(random() * keys.length)]!, {
          value: randomValue(random, depth - 1),
          enumerable: true,
          writable: true,
          configurable: true,
        });
      }
      return object;
    }
    default:
      return Array.from({ length: Math.floor(random() * 4) }, () => randomValue(random, depth - 1));
  }
}

Deno.test("canonicalJson writes every value as the reference does", () => {
  const random = seededRandom(7240);
  for (let i = 0; i < 5_000; i++) {
    const value = randomValue(random, 4);
    assert.equal(canonicalJson(value), canonicalReference(value), JSON.stringify(value));
  }
  const body = JSON.parse('{"z":1,"__proto__":{"b":[1,{"y":2,"x":null}]},"a":"é"}');
  assert.equal(canonicalJson(body), '{"__proto__":{"b":[1,{"x":null,"y":2}]},"a":"é","z":1}');
});

Deno.test("parseRunRequest answers every body exactly as the zod schema does", () => {
  const random = seededRandom(23);
  const inputs: unknown[] = [{}, { ticket: "x" }, JSON.parse('{"__proto__":{"a":1}}'), [], ["a"], null, "x", 1];
  const bodies: unknown[] = [null, "x", 1, [], {}, { notify: "ops@example.com" }];
  for (const input of inputs) {
    bodies.push({ input });
    for (const notify of NOTIFY_CASES) bodies.push({ input, notify }, { notify, input });
    for (const extra of [{ version: 2 }, { version: 0 }, { version: 1.5 }, { priority: "high" }, { other: 1 }]) {
      bodies.push({ input, ...extra }, { input, notify: "ops@example.com", ...extra });
    }
  }
  bodies.push(JSON.parse('{"input":{},"__proto__":{"a":1}}'));
  bodies.push(JSON.parse('{"__proto__":{"input":{}}}'));
  bodies.push(Object.assign(Object.create({ inherited: 1 }), { input: {} }));
  bodies.push(Object.assign(Object.create({ input: {} }), { notify: "ops@example.com" }));
  for (const inherited of [{ version: 0 }, { version: 2 }, { notify: "x" }, { priority: "high" }, { expires_in: 5 }]) {
    bodies.push(Object.assign(Object.create(inherited), { input: {} }));
    bodies.push(Object.assign(Object.create(inherited), { input: {}, notify: "ops@example.com" }));
  }
  for (const notify of randomAddresses(random, 1_000)) bodies.push({ input: { ticket: "t" }, notify });
  for (const body of bodies) {
    const fast = parseRunRequest(body);
    const zod = RunRequest.safeParse(body);
    assertParsedAlike(body, fast, zod);
    if (fast.success && zod.success) assert.equal(fast.data.input, zod.data.input, "the input itself, not a copy");
  }
});

Deno.test("jobFields reads a message's fields as zod does, and refuses what zod refuses", () => {
  const ids = [
    crypto.randomUUID(),
    crypto.randomUUID().toUpperCase(),
    "00000000-0000-0000-0000-000000000000",
    "ffffffff-ffff-ffff-ffff-ffffffffffff",
    "6f1c2b7e-4d0a-9c39-9a6e-2f4b8d1e0c57",
    "6f1c2b7e-4d0a-5c39-7a6e-2f4b8d1e0c57",
    "6f1c2b7e4d0a5c399a6e2f4b8d1e0c57",
    "",
    undefined,
  ];
  for (const job_id of ids) {
    for (const tenant of ["acme", "", undefined]) {
      for (const payload of ["{}", "", undefined]) {
        const fields: Record<string, unknown> = { job_id, tenant, payload, traceparent: "x" };
        for (const k of Object.keys(fields)) if (fields[k] === undefined) delete fields[k];
        const zod = JobFields.safeParse(fields);
        if (zod.success) {
          assert.deepEqual(jobFields(fields), zod.data);
        } else {
          assert.throws(() => jobFields(fields), PermanentJobError, JSON.stringify(fields));
        }
      }
    }
  }
});

Deno.test("renderedChars comes to the rendered length for random templates, asked twice", () => {
  const random = seededRandom(156);
  const parts = [
    "{{input.a}}",
    "{{ input.b.c }}",
    "{{input.nope}}",
    "{{input.b}}",
    "{{input.a.length}}",
    "x",
    "{{",
    "é",
  ];
  const inputs = [{ a: "x".repeat(17), b: { c: [1, "two", { d: null }] } }, { a: [true], b: "é" }, {}];
  for (let i = 0; i < 500; i++) {
    let prompt = "";
    for (let n = Math.floor(random() * 8); n > 0; n--) prompt += parts[Math.floor(random() * parts.length)];
    // The template is read once; each input is measured anew.
    for (const input of inputs) {
      assert.equal(renderedChars({ prompt }, input), renderTemplate(prompt, input).length, prompt);
      assert.equal(renderedChars({ prompt, system: prompt }, input), 2 * renderTemplate(prompt, input).length);
    }
  }
});
