/**
 * `deno run <flags> tests/support/validation_probe.ts <schema> <instance> [process|thread]`:
 * validates the instance (JSON) against the schema (JSON) in a validation
 * child process (or on a Web Worker, as a compiled binary does) and prints
 * the violations as JSON, or `failed: <message>`. Run with a command's
 * permission set, it shows whether that set lets the process start it.
 */
import { createSchemaValidators } from "../../src/tasks/validator.ts";

const [schema, instance] = Deno.args.slice(0, 2).map((arg) => JSON.parse(arg));
const isolation = (Deno.args[2] ?? "process") as "process" | "thread";
// Every validation goes to a Worker, whatever the schema.
const validators = createSchemaValidators({ fastPathUnits: 0, isolation });
try {
  console.log(JSON.stringify(await validators.validate("probe", schema, instance)));
} catch (error) {
  console.log(`failed: ${error instanceof Error ? error.message : String(error)}`);
} finally {
  await validators.close();
}
