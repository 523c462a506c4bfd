/**
 * A flow script call's reply, remembered so that the same call applied twice
 * changes the provider's state once. ioredis resends, after reconnecting,
 * every command that was on the wire unanswered, and Redis may already have
 * run it: a resent take would book a second slot (or be told to wait for the
 * probe lease it holds itself), a resent settle would give tokens back twice
 * and count a failure twice. Each call carries an id; the script stores its
 * reply under the caller's memo key, and a call whose id is already there gets
 * that reply back and writes nothing.
 *
 * One memo key per flow and script (each flow sends one batch of each at a
 * time, so only the call in flight can be resent), beside the state hash in
 * its Redis Cluster slot.
 */

/** Where a script call keeps its reply, and the call's id (see the module comment). */
export interface ReplyMemo {
  /** The caller's memo key ({@linkcode replyMemoKey}). */
  key: string;
  /** This call's id: a resend carries the same one. */
  callId: string;
}

/** The memo key of one flow (`owner`, random per flow) for one script, beside the state hash `stateKey`. */
export function replyMemoKey(stateKey: string, owner: string, script: "acquire" | "settle"): string {
  return `${stateKey}:replies:${owner}:${script}`;
}
