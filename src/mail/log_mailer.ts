import type { Mailer } from "./mailer.ts";

/** The embedded default: writes each email as one JSON line (to stdout by default). */
export function createLogMailer(write: (line: string) => void = (line) => console.log(line)): Mailer {
  return {
    send(email, idempotencyKey, signal) {
      signal.throwIfAborted();
      write(JSON.stringify({ event: "email", idempotency_key: idempotencyKey, ...email }));
      return Promise.resolve({ ok: true });
    },
  };
}
