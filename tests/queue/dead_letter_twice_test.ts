/**
 * Dead-lettering and replay applied twice, as ioredis's resend after a lost
 * reply applies them: the same command with the same arguments, which Redis
 * may already have run. The second application must find nothing to do.
 * (Run on one Redis and, by `deno task test:cluster`, on a Redis Cluster.)
 */
import assert from "node:assert/strict";
import { DEAD_LETTER_BOUNDS, deadLetter, listDeadLetters, replayDeadLetter } from "../../src/queue/dead_letter.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import type { StreamMessage } from "../../src/queue/message.ts";
import { createTestRedis } from "../_support.ts";
import { recordingRedis, resendingRedis, sendAgain } from "../support/resending_redis.ts";

Deno.test("dead letters and replays applied twice", async (t) => {
  const r = await createTestRedis();
  const n = { stream: `${r.prefix}:{q}:stream`, dead: `${r.prefix}:{q}:dead`, group: "g" };
  const reset = async () => {
    await r.redis.del(n.stream, n.dead);
    await ensureGroup(r.redis, n);
  };
  /** Adds a job's entry and delivers it to consumer `c`, as a worker's read does. */
  const deliver = async (jobId: string): Promise<StreamMessage> => {
    await r.redis.xadd(n.stream, "*", "job_id", jobId, "tenant", "acme");
    const reply = await r.redis.xreadgroup("GROUP", n.group, "c", "COUNT", 1, "STREAMS", n.stream, ">") as [
      string,
      [string, string[]][],
    ][];
    const [id] = reply[0]![1][0]!;
    return { id, fields: { job_id: jobId, tenant: "acme" }, deliveries: 1 };
  };
  /** The effect counts: dead letters, entries in the job stream, entries pending in its group. */
  const counts = async () => ({
    dead: await r.redis.xlen(n.dead),
    stream: await r.redis.xlen(n.stream),
    pending: ((await r.redis.xpending(n.stream, n.group)) as [number])[0],
  });
  try {
    await t.step("deadLetter() run twice on one delivered message makes one dead letter", async () => {
      await reset();
      const message = await deliver("j-twice");
      assert.deepEqual(await counts(), { dead: 0, stream: 1, pending: 1 });
      await deadLetter(r.redis, n, message, "permanent: 400");
      await deadLetter(r.redis, n, message, "permanent: 400");
      assert.deepEqual(await counts(), { dead: 1, stream: 0, pending: 0 });
      const [dead] = await listDeadLetters(r.redis, n);
      assert.deepEqual([dead!.original_id, dead!.fields.job_id], [message.id, "j-twice"]);
    });

    await t.step("the dead-letter step resent by EVALSHA, after its reply was lost, writes nothing", async () => {
      await reset();
      const message = await deliver("j-resent");
      const recording = recordingRedis(r.redis);
      await deadLetter(recording.redis, n, message, "exceeded 5 deliveries");
      assert.deepEqual(await counts(), { dead: 1, stream: 0, pending: 0 });
      // The whole step is one script, so a resend repeats all of it or nothing: there is no MULTI to half-resend.
      const sent = recording.sent.at(-1);
      assert.ok(sent, "dead-lettering sends one script");
      assert.equal(await sendAgain(r.redis, sent), null, "the resend answers that the message is gone");
      assert.deepEqual(await counts(), { dead: 1, stream: 0, pending: 0 });
    });

    await t.step("a message settled meanwhile (acknowledged and deleted) is not dead-lettered", async () => {
      await reset();
      const message = await deliver("j-settled");
      await r.redis.xack(n.stream, n.group, message.id);
      await r.redis.xdel(n.stream, message.id);
      assert.equal(await deadLetter(r.redis, n, message, "late"), 0);
      assert.deepEqual(await counts(), { dead: 0, stream: 0, pending: 0 });
    });

    await t.step("an entry never delivered is dead-lettered from the stream, once", async () => {
      await reset();
      const id = await r.redis.xadd(n.stream, "*", "job_id", "j-undelivered") as string;
      const message = { id, fields: { job_id: "j-undelivered" }, deliveries: 0 };
      await deadLetter(r.redis, n, message, "unreadable");
      await deadLetter(r.redis, n, message, "unreadable");
      assert.deepEqual(await counts(), { dead: 1, stream: 0, pending: 0 });
    });

    await t.step("a field cut inside a character is still dead-lettered, the lone half kept as U+FFFD", async () => {
      await reset();
      const message = await deliver("j-emoji");
      // The cut at keptFieldChars falls between the two halves of the emoji; the reason ends with a lone half.
      message.fields.payload = "x".repeat(DEAD_LETTER_BOUNDS.keptFieldChars - 1) + "\u{1F600}";
      await deadLetter(r.redis, n, message, "permanent: \uD83D");
      assert.deepEqual(await counts(), { dead: 1, stream: 0, pending: 0 });
      const [dead] = await listDeadLetters(r.redis, n);
      assert.equal(dead!.fields.payload, "x".repeat(DEAD_LETTER_BOUNDS.keptFieldChars - 1) + "\uFFFD");
      assert.equal(dead!.reason, "permanent: \uFFFD");
      assert.deepEqual(dead!.truncated, ["payload"]);
    });

    await t.step("replayDeadLetter() resent after a lost reply re-enqueues once and answers its entry", async () => {
      await reset();
      await deadLetter(r.redis, n, await deliver("j-replay"), "permanent: 400");
      const [dead] = await listDeadLetters(r.redis, n);
      const newId = await replayDeadLetter(resendingRedis(r.redis), n, dead!.id);
      assert.ok(newId, "the resend answers as the replay did: the new entry's id");
      assert.deepEqual(await counts(), { dead: 0, stream: 1, pending: 0 });
      const [entry] = await r.redis.xrange(n.stream, newId, newId);
      assert.deepEqual(entry![1], ["job_id", "j-replay", "tenant", "acme"]);
      // A second replay (another operation, not a resend) finds it replayed: nothing more.
      assert.equal(await replayDeadLetter(r.redis, n, dead!.id), null);
      assert.deepEqual(await counts(), { dead: 0, stream: 1, pending: 0 });
    });
  } finally {
    await r.close();
  }
});
