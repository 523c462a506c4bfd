/**
 * The SDK-only ceiling for the worker benchmark: the same `openai` SDK client
 * the worker uses (through our adapter, retries off), calling the same fake
 * model at the same concurrency, with nothing else. Prints "ready" after a
 * warm-up, waits for a line on stdin, makes CALLS calls, prints
 * "done <seconds>", then waits for SIGTERM (so the parent can read its CPU).
 * Usage: sdk_ceiling.ts BASE_URL CONCURRENCY CALLS
 */
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { summaryPrompt } from "../../src/llm/llm.ts";

const [baseURL, concurrencyArg, callsArg] = Deno.args;
const concurrency = Number(concurrencyArg);
const calls = Number(callsArg);
const llm = createOpenAiLlm({ apiKey: "sk-bench", model: "bench", baseURL });
const prompt = summaryPrompt(
  "Revenue rose 12% in Q3. Costs fell. The board approved the expansion plan for next year.",
);
const signal = new AbortController().signal;

async function drive(n: number) {
  let next = 0;
  await Promise.all(Array.from({ length: Math.min(concurrency, n) }, async () => {
    while (next < n) {
      next++;
      await llm.complete(prompt, { signal });
    }
  }));
}

await drive(Math.min(500, calls));
console.log("ready");
const reader = Deno.stdin.readable.getReader();
await reader.read();
const started = performance.now();
await drive(calls);
console.log(`done ${(performance.now() - started) / 1000}`);
await new Promise<void>((resolve) => Deno.addSignalListener("SIGTERM", resolve));
