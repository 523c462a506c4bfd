/**
 * `deno run -A tests/bench/validation_bench.ts`: the median cost of one
 * validation in the caller's thread (the estimate and the validation) and
 * on a Worker (the round trip with the instance's structured clone), for a
 * small instance and 50 KB ones, beside `compileSchema(...).validate` alone;
 * and what sending a schema with every message would add. Prints a table.
 */
import { compileSchema } from "../../src/tasks/json_schema.ts";
import { createSchemaValidators } from "../../src/tasks/validator.ts";
import { fmt, median } from "./stats.ts";

const TICKET = {
  type: "object",
  properties: {
    body: { type: "string", maxLength: 100_000 },
    customer: { type: "object", properties: { name: { type: "string" }, tier: { enum: ["free", "pro"] } } },
    tags: { type: "array", items: { type: "string" }, maxItems: 5 },
  },
  required: ["body"],
};
const TICKETS = { type: "object", properties: { tickets: { type: "array", items: TICKET } } };
const ticket = {
  body: "The invoice for March is wrong: it bills us twice.",
  customer: { name: "Ada" },
  tags: ["billing"],
};

const cases = [
  { name: "small (~200 B)", schema: TICKET, instance: { ...ticket, body: ticket.body.repeat(3) } },
  { name: "50 KB, one string", schema: TICKET, instance: { ...ticket, body: "x".repeat(50_000) } },
  { name: "50 KB, 450 objects", schema: TICKETS, instance: { tickets: Array.from({ length: 450 }, () => ticket) } },
];

async function timeEach(runs: number, f: () => unknown): Promise<number> {
  const times: number[] = [];
  for (let i = 0; i < runs; i++) {
    const started = performance.now();
    await f();
    times.push((performance.now() - started) * 1_000);
  }
  return median(times);
}

const inThread = createSchemaValidators({ fastPathUnits: Infinity });
const onWorker = createSchemaValidators({ fastPathUnits: 0, workers: 1 });
const routed = createSchemaValidators();
const rows: string[] = ["| instance | bytes | compileSchema alone µs | in thread µs | on a Worker µs | default path |"];
rows.push("| --- | --- | --- | --- | --- | --- |");
try {
  for (const { name, schema, instance } of cases) {
    const bytes = JSON.stringify(instance).length;
    const compiled = compileSchema(structuredClone(schema));
    const runs = 1_000;
    const time = async (validate: () => unknown) => {
      await timeEach(200, validate);
      return await timeEach(runs, validate);
    };
    const alone = await time(() => compiled.validate(instance));
    const thread = await time(() => inThread.validate(name, schema, instance));
    const worker = await time(() => onWorker.validate(name, schema, instance));
    let fast = false;
    const answer = routed.validate(name, schema, instance).then(() => (fast = true));
    await Promise.resolve();
    await Promise.resolve();
    const path = fast ? "thread" : "Worker";
    await answer;
    rows.push(`| ${name} | ${bytes} | ${fmt(alone, 1)} | ${fmt(thread, 1)} | ${fmt(worker, 1)} | ${path} |`);
  }
  const big = {
    type: "object",
    properties: Object.fromEntries(Array.from({ length: 600 }, (_, i) => [`field${i}`, { type: "string" }])),
  };
  for (const [name, schema] of [["small", TICKET], [`${JSON.stringify(big).length} B`, big]] as const) {
    const clone = await timeEach(300, () => structuredClone(schema));
    rows.push(`| structuredClone of a ${name} schema | | ${fmt(clone, 1)} | | | |`);
  }
} finally {
  await Promise.all([inThread.close(), onWorker.close(), routed.close()]);
}
console.log(rows.join("\n"));
