/**
 * Redis clients that replay what ioredis does after a lost reply: with
 * `autoResendUnfulfilledCommands` (on by default), a command that was on the
 * wire when its connection dropped is sent again on the new connection,
 * though Redis may already have run it. Tests use these to apply a script
 * twice exactly as a resend would: the same command, the same arguments.
 */
import type { RedisClient } from "../../src/clients.ts";

type Send = (...args: unknown[]) => Promise<unknown>;

/** A script call as it was sent: `evalsha` or `eval` and its arguments. */
export interface SentScript {
  command: "evalsha" | "eval";
  args: unknown[];
}

function wrap(redis: RedisClient, call: (command: SentScript["command"], send: Send, args: unknown[]) => unknown) {
  return new Proxy(redis, {
    get(target, prop) {
      const value = Reflect.get(target, prop, target);
      if (prop === "evalsha" || prop === "eval") {
        const send = (value as Send).bind(target);
        return (...args: unknown[]) => call(prop, send, args);
      }
      return typeof value === "function" ? value.bind(target) : value;
    },
  }) as RedisClient;
}

/**
 * `redis`, except that every script call (EVALSHA, or EVAL after NOSCRIPT) runs twice: the first reply is
 * lost, and the caller is answered by the second, as after a dropped connection and a resend.
 */
export function resendingRedis(redis: RedisClient): RedisClient {
  return wrap(redis, async (_command, send, args) => {
    // The first application's error is lost with its reply, as its answer would be.
    await send(...args).catch(() => {});
    return await send(...args);
  });
}

/** `redis`, recording every script call it sends, so a test can send one again verbatim. */
export function recordingRedis(redis: RedisClient): { redis: RedisClient; sent: SentScript[] } {
  const sent: SentScript[] = [];
  return {
    sent,
    redis: wrap(redis, (command, send, args) => {
      sent.push({ command, args });
      return send(...args);
    }),
  };
}

/** `redis`, calling `after` with each script's reply before the caller sees it (to change things between steps). */
export function afterEachScript(redis: RedisClient, after: (reply: unknown) => Promise<void>): RedisClient {
  return wrap(redis, async (_command, send, args) => {
    const reply = await send(...args);
    await after(reply);
    return reply;
  });
}

/** Sends `script` again, exactly as it was sent (a resend after the reply was lost). @returns Redis's reply. */
export async function sendAgain(redis: RedisClient, script: SentScript): Promise<unknown> {
  const send = redis[script.command] as unknown as Send;
  return await send.apply(redis, script.args);
}
