/**
 * A pool's served module for tests of `worker_pool.ts` itself: `{ id, do, payload? }` answers
 * `{ id, done: pid, length }` (the payload's length) after `do`: `"echo"`; `"spin"`, a loop that never ends;
 * `"grow"`, allocation without bound; `"print"`, a line on standard output that is not a message.
 */
import { serveWorker } from "../../src/tasks/_pool_worker.ts";

serveWorker<{ id: number; do: "echo" | "spin" | "grow" | "print"; payload?: string }>(() => {}, (message) => {
  if (message.do === "spin") { for (;;); }
  if (message.do === "grow") {
    const kept: number[][] = [];
    for (;;) kept.push(new Array(1_000_000).fill(kept.length));
  }
  if (message.do === "print") console.log("hello");
  return { id: message.id, done: Deno.pid, length: message.payload?.length ?? 0 };
});
