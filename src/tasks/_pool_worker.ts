/**
 * The Worker's side of `worker_pool.ts`, in a child process or on a Web
 * Worker (`pool_channels.ts`): what a pool and its Workers say to each other
 * first, and the state a Web Worker shares with it. A module of its own with
 * no imports, so that the starting side does not load a Worker's module, nor
 * a Worker the pool's.
 */

/**
 * A Worker's state, element 0 of an Int32Array both sides share. The Worker goes from `idle` to `busy` to begin
 * a piece of work and back when it is done; the starting side, when it terminates the Worker, from `idle` to
 * `cancelled`. Both by compare-and-exchange: work the Worker had not begun then, it never begins; work it had,
 * the starting side sees as `busy`, and counts the Worker until it is `idle` again.
 */
export const POOL_STATE = { idle: 0, busy: 1, cancelled: 2 } as const;

/** The argument a pool's child process is started with (`pool_channels.ts`): it serves its standard input. */
export const POOL_PROCESS_ARG = "--oncely-pool-process";

/**
 * The first message: the caller's own settings, and for a Worker the shared state's buffer (a child process has
 * none: it is killed, not asked to stop). Answered `ready`.
 */
export interface PoolInit {
  type: "init";
  state?: SharedArrayBuffer;
  options: Record<string, unknown>;
}

/** Said once the Worker has its settings: its loading does not count against the first work's deadline. */
export type PoolReply = { type: "ready" };

interface WorkerScope {
  onmessage: ((event: MessageEvent) => void) | null;
  postMessage(message: unknown): void;
}

/**
 * Serves a pool from inside a Worker, or from a child process started with {@linkcode POOL_PROCESS_ARG}: `init`
 * receives the pool's settings; `handle` does one piece of work and
 * returns its last reply, posted once the Worker is `idle` again (so the pool, which frees the Worker on that
 * reply, never finds it still `busy`), or undefined when it has posted what it had to (through `post`).
 * Work that arrives after the pool terminated this Worker is dropped unbegun.
 */
export function serveWorker<M>(
  init: (options: Record<string, unknown>) => void,
  handle: (message: M, post: (reply: unknown) => void) => unknown,
): void {
  if (Deno.args.includes(POOL_PROCESS_ARG)) return void serveProcess(init, handle);
  const scope = globalThis as unknown as WorkerScope;
  const post = (reply: unknown) => scope.postMessage(reply);
  let state: Int32Array | undefined;
  scope.onmessage = ({ data }: MessageEvent) => {
    if (state === undefined) {
      const { state: buffer, options } = data as PoolInit;
      state = new Int32Array(buffer!);
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

/**
 * Serves a pool from a child process: a message a line of JSON on standard input, a reply a line on standard
 * output. It ends when its input does (the pool, or the process that started it, has gone).
 */
async function serveProcess<M>(
  init: (options: Record<string, unknown>) => void,
  handle: (message: M, post: (reply: unknown) => void) => unknown,
): Promise<void> {
  const encoder = new TextEncoder();
  const post = (reply: unknown) => {
    const bytes = encoder.encode(`${JSON.stringify(reply)}\n`);
    for (let at = 0; at < bytes.length;) at += Deno.stdout.writeSync(bytes.subarray(at));
  };
  let initialised = false;
  const lines = lineSplitter((line) => {
    const data = JSON.parse(line);
    if (!initialised) {
      initialised = true;
      init((data as PoolInit).options);
      return post({ type: "ready" } satisfies PoolReply);
    }
    const last = handle(data as M, post);
    if (last !== undefined) post(last);
  });
  for await (const text of Deno.stdin.readable.pipeThrough(new TextDecoderStream())) lines.push(text);
}

/**
 * Splits text that arrives in pieces into lines, each to `line` without its newline; what follows the last
 * newline waits for the next piece. A long line costs its length once, however many pieces it comes in.
 */
export function lineSplitter(line: (text: string) => void): { push(text: string): void } {
  let pending: string[] = [];
  return {
    push(text) {
      let from = 0;
      for (let end = text.indexOf("\n"); end >= 0; end = text.indexOf("\n", from)) {
        pending.push(text.slice(from, end));
        const whole = pending.length === 1 ? pending[0]! : pending.join("");
        pending = [];
        from = end + 1;
        line(whole);
      }
      if (from < text.length) pending.push(text.slice(from));
    },
  };
}
