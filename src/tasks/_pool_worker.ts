/**
 * The Worker's side of `worker_pool.ts`: what a pool and its Workers say to
 * each other first, and the state they share. A module of its own with no
 * imports, so that the starting side does not load a Worker's module, nor a
 * Worker the pool's.
 */

/**
 * A Worker's state, element 0 of an Int32Array both sides share. The Worker goes from `idle` to `busy` to begin
 * a piece of work and back when it is done; the starting side, when it terminates the Worker, from `idle` to
 * `cancelled`. Both by compare-and-exchange: work the Worker had not begun then, it never begins; work it had,
 * the starting side sees as `busy`, and counts the Worker until it is `idle` again.
 */
export const POOL_STATE = { idle: 0, busy: 1, cancelled: 2 } as const;

/** The first message: the shared state's buffer, and the caller's own settings. Answered `ready`. */
export interface PoolInit {
  type: "init";
  state: SharedArrayBuffer;
  options: Record<string, unknown>;
}

/** Said once the Worker has its settings: its loading does not count against the first work's deadline. */
export type PoolReply = { type: "ready" };

interface WorkerScope {
  onmessage: ((event: MessageEvent) => void) | null;
  postMessage(message: unknown): void;
}

/**
 * Serves a pool from inside a Worker: `init` receives the pool's settings; `handle` does one piece of work and
 * returns its last reply, posted once the Worker is `idle` again (so the pool, which frees the Worker on that
 * reply, never finds it still `busy`), or undefined when it has posted what it had to (through `post`).
 * Work that arrives after the pool terminated this Worker is dropped unbegun.
 */
export function serveWorker<M>(
  init: (options: Record<string, unknown>) => void,
  handle: (message: M, post: (reply: unknown) => void) => unknown,
): void {
  const scope = globalThis as unknown as WorkerScope;
  const post = (reply: unknown) => scope.postMessage(reply);
  let state: Int32Array | undefined;
  scope.onmessage = ({ data }: MessageEvent) => {
    if (state === undefined) {
      const { state: buffer, options } = data as PoolInit;
      state = new Int32Array(buffer);
      init(options);
      return post({ type: "ready" } satisfies PoolReply);
    }
    if (Atomics.compareExchange(state, 0, POOL_STATE.idle, POOL_STATE.busy) !== POOL_STATE.idle) return;
    let last: unknown;
    try {
      last = handle(data as M, post);
    } finally {
      Atomics.store(state, 0, POOL_STATE.idle);
    }
    if (last !== undefined) post(last);
  };
}
