import assert from "node:assert/strict";
import { createLogger } from "../../src/log/logger.ts";

Deno.test("the logger writes one JSON object per line with level, event and fields, above LOG_LEVEL only", () => {
  const lines: string[] = [];
  const log = createLogger({ level: "info", write: (l) => lines.push(l), now: () => new Date(0) })
    .child({ job_id: "j1", tenant: "acme" });
  log.debug("hidden");
  log.info("job_done", { msg_id: "1-0", attempt: 2 });
  log.error("boom", { error: new TypeError("bad value") });
  assert.equal(lines.length, 2);
  assert.deepEqual(JSON.parse(lines[0]!), {
    ts: "1970-01-01T00:00:00.000Z",
    level: "info",
    event: "job_done",
    job_id: "j1",
    tenant: "acme",
    msg_id: "1-0",
    attempt: 2,
  });
  const error = JSON.parse(lines[1]!);
  assert.deepEqual(error.error, { name: "TypeError", message: "bad value" }, "errors are logged without stacks");
  assert.ok(lines.every((l) => !l.includes("\n")));
});

/** The line as the logger wrote it before lines were built as strings: `JSON.stringify` of the record. */
function reference(level: string, event: string, base: Record<string, unknown>, fields: Record<string, unknown>) {
  const describe = (v: unknown) => v instanceof Error ? { name: v.name, message: v.message } : v;
  const record: Record<string, unknown> = { ts: "1970-01-01T00:00:00.000Z", level, event, ...base };
  for (const [k, v] of Object.entries(fields)) record[k] = describe(v);
  return JSON.stringify(record);
}

Deno.test("each line is exactly the JSON of {ts, level, event, ...base, ...fields}, whatever the fields", () => {
  const cases: [Record<string, unknown>, Record<string, unknown>][] = [
    [{}, {}],
    [{ process: "api" }, { job_id: "j1", tenant: 'a"b\\c\u2028\u0000é', n: 1.5, ok: true, none: null }],
    [{ process: "api" }, { skipped: undefined, fn: () => 1, nested: { a: [1, "x", { b: undefined }] } }],
    [{ process: "api" }, { error: new RangeError("out of range") }],
    // A field that replaces an earlier key keeps that key's place, as with the object.
    [{ process: "api", tenant: "t" }, { tenant: "other", x: 1 }],
    [{ process: "api" }, { event: "shadowed", level: "shadowed" }],
    [{ ts: "base's own", level: "base's own" }, { a: 1 }],
  ];
  for (const [base, fields] of cases) {
    const lines: string[] = [];
    createLogger({ level: "debug", write: (l) => lines.push(l), now: () => new Date(0) }).child(base)
      .info('ev"ent', fields);
    assert.equal(lines[0], reference("info", 'ev"ent', base, fields), JSON.stringify(base));
  }
});

/** Runs `code` (which may use `log`, an info-level stderr logger) in a process of its own; its stderr lines. */
async function loggedBy(code: string, { stdin }: { stdin?: (lines: () => Promise<string[]>) => Promise<void> } = {}) {
  const logger = new URL("../../src/log/logger.ts", import.meta.url).href;
  const child = new Deno.Command(Deno.execPath(), {
    args: ["eval", `import { createLogger } from "${logger}"; const log = createLogger({ level: "info" }); ${code}`],
    stdin: "piped",
    stdout: "null",
    stderr: "piped",
  }).spawn();
  const reader = child.stderr.pipeThrough(new TextDecoderStream()).getReader();
  let text = "";
  const events = () => text.split("\n").filter((l) => l.startsWith("{")).map((l) => JSON.parse(l).event as string);
  const more = async () => {
    const { value, done } = await reader.read();
    if (!done) text += value;
    return events();
  };
  await stdin?.(more);
  await child.stdin.close();
  while (!(await reader.read().then(({ value, done }) => (text += value ?? "", done)))) { /* to the end */ }
  await child.status;
  return events();
}

Deno.test("a warn or error line is written at once, after every info line before it", async () => {
  const seen = await loggedBy(
    `log.info("first"); log.info("second"); log.warn("third");
     for await (const _ of Deno.stdin.readable) { /* held open until the test has read the lines */ }`,
    {
      stdin: async (more) => {
        // The process is still running: the warn line did not wait for a flush, and took the info lines with it.
        let lines: string[] = [];
        while (lines.length < 3) lines = await more();
        assert.deepEqual(lines, ["first", "second", "third"]);
      },
    },
  );
  assert.deepEqual(seen, ["first", "second", "third"]);
});

Deno.test("info lines still waiting are written when the process exits, or dies of an uncaught error", async () => {
  assert.deepEqual(await loggedBy(`log.info("a"); log.info("b"); Deno.exit(0);`), ["a", "b"]);
  assert.deepEqual(await loggedBy(`log.info("a"); log.info("b");`), ["a", "b"]);
  // A line longer than a pipe's atomic write goes out whole, between the others.
  assert.deepEqual(
    await loggedBy(`log.info("a"); log.info("long", { x: "y".repeat(10_000) }); log.info("b");`),
    ["a", "long", "b"],
  );
  assert.deepEqual(await loggedBy(`log.info("a"); setTimeout(() => { throw new Error("boom"); }, 0);`), ["a"]);
  assert.deepEqual(await loggedBy(`log.info("a"); Promise.reject(new Error("boom"));`), ["a"]);
});

Deno.test("processes sharing one stderr pipe never interleave parts of lines", async () => {
  const logger = new URL("../../src/log/logger.ts", import.meta.url).href;
  const code = `import { createLogger } from "${logger}"; const log = createLogger({ level: "info" });
    for (let i = 0; i < 4000; i++) log.info("line", { i, pad: "x".repeat(150 + (i % 50)) });`;
  const deno = Deno.execPath();
  // Two processes writing at once into the pipe of the shell that started them, as `api --parallel` does.
  const out = await new Deno.Command("sh", {
    args: ["-c", `"$0" eval "$1" & "$0" eval "$1" & wait`, deno, code],
    stdout: "null",
    stderr: "piped",
  }).output();
  const lines = new TextDecoder().decode(out.stderr).split("\n").filter(Boolean);
  assert.equal(lines.length, 8000);
  for (const line of lines) assert.equal(JSON.parse(line).event, "line");
});
