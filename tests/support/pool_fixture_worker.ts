/**
 * A pool's served module for tests of `worker_pool.ts` itself: `{ id, do }` answers `{ id, done: pid }` after
 * `do` (`"echo"`; `"spin"`, a loop that never ends; `"grow"`, allocation without bound).
 */
import { serveWorker } from "../../src/tasks/_pool_worker.ts";

serveWorker<{ id: number; do: "echo" | "spin" | "grow" }>(() => {}, ({ id, do: what }) => {
  if (what === "spin") { for (;;); }
  if (what === "grow") {
    const kept: number[][] = [];
    for (;;) kept.push(new Array(1_000_000).fill(kept.length));
  }
  return { id, done: Deno.pid };
});
