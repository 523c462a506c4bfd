/**
 * Runs `task` every `ms` until the returned function is called. A failed run
 * goes to `onError`, and the next run still comes.
 */
export function every(ms: number, task: () => Promise<unknown>, onError: (error: unknown) => void): () => void {
  const timer = setInterval(() => {
    task().catch(onError);
  }, ms);
  return () => clearInterval(timer);
}
