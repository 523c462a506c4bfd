/**
 * `deno run <flags> tests/support/validation_probe.ts <schema> <instance>`:
 * validates the instance (JSON) against the schema (JSON) on a validation
 * Worker and prints the violations as JSON, or `failed: <message>`. Run
 * with a command's permission set, it shows whether that set lets the
 * process start the Worker.
 */
import { createSchemaValidators } from "../../src/tasks/validator.ts";

const [schema, instance] = Deno.args.map((arg) => JSON.parse(arg));
// Every validation goes to a Worker, whatever the schema.
const validators = createSchemaValidators({ fastPathUnits: 0 });
try {
  console.log(JSON.stringify(await validators.validate("probe", schema, instance)));
} catch (error) {
  console.log(`failed: ${error instanceof Error ? error.message : String(error)}`);
} finally {
  await validators.close();
}
