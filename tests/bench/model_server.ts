/**
 * The fake Chat Completions server as its own process, so the model's CPU is
 * not charged to the process under test. Prints its base URL, then serves
 * until SIGTERM. Usage: model_server.ts DELAY_MS
 */
import { startFakeModel } from "../support/fake_model_server.ts";

const delayMs = Number(Deno.args[0] ?? 0);
const model = startFakeModel(() => ({ kind: "ok", delayMs }));
console.log(model.url);
await new Promise<void>((resolve) => Deno.addSignalListener("SIGTERM", resolve));
await model.close();
