/**
 * `deno run --allow-read tests/support/definition_check_exit.ts`: checks one definition on a checker it never
 * closes, then returns from its module. With the Worker stopped once idle, the process exits by itself.
 */
import { createDefinitionChecker } from "../../src/tasks/definition_checker.ts";

const checker = createDefinitionChecker({ idleMs: 200 });
await checker.check(
  JSON.stringify({ prompt: "Hi {{input.a}}", input_schema: { type: "object", properties: { a: { type: "string" } } } }),
  "probe",
);
console.log("checked");
