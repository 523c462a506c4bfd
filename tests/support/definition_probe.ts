/**
 * `deno run <flags> tests/support/definition_probe.ts <definition> [process|thread]`:
 * checks the definition (JSON) in a definition check child process (or on a
 * Web Worker, as a compiled binary does) and prints `passed`,
 * `refused <pointer>: <message>` or `failed: <message>`. Run with a
 * command's permission set, it shows whether that set lets the process
 * start the Worker.
 */
import { createDefinitionChecker } from "../../src/tasks/definition_checker.ts";
import { DefinitionRefused } from "../../src/tasks/definition_check.ts";

const checker = createDefinitionChecker({ isolation: (Deno.args[1] ?? "process") as "process" | "thread" });
try {
  await checker.check(Deno.args[0]!, "probe");
  console.log("passed");
} catch (error) {
  if (error instanceof DefinitionRefused) console.log(`refused ${error.pointer}: ${error.message}`);
  else console.log(`failed: ${error instanceof Error ? error.message : String(error)}`);
} finally {
  await checker.close();
}
