/**
 * Replaying a summary job's dead letter changes Postgres too: it takes back
 * the job's 'failed' outcome. Two replays of one dead letter at once, a
 * replay whose scripts are resent after lost replies, and a dead-lettering
 * resent after its job was replayed must each leave one replay: the job
 * queued once, undecided in `job_outcomes`, its status record `queued`.
 * (Run on one Redis and, by `deno task test:cluster`, on a Redis Cluster.)
 */
import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { dlqCommand } from "../../src/cli/dlq_command.ts";
import { failJob } from "../../src/jobs/job_store.ts";
import { deadLetter, listDeadLetters } from "../../src/queue/dead_letter.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import type { StreamMessage } from "../../src/queue/message.ts";
import { replayDeadLetters, type ReplayReport } from "../../src/runs/dead_letters.ts";
import { markFailedHook } from "../../src/runs/job_status.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { afterEachScript, resendingRedis } from "../support/resending_redis.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const REASON = "permanent: UpstreamHttpError: Upstream answered 400";

Deno.test("replays of one dead letter", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);

  /**
   * A job that failed for good, as a worker leaves it: delivered, decided 'failed' in Postgres, then
   * dead-lettered with its status record marked failed. @returns its job id, message and dead letter's id.
   */
  const deadJob = async (tenant: string) => {
    const lane = keys.lane(tenant);
    const jobId = crypto.randomUUID();
    await ensureGroup(r.redis, lane);
    await enqueueToLane(r.redis, keys, { jobId, tenant, request: { text: "A report.", notify: "ops@example.com" } });
    const reply = await r.redis.xreadgroup("GROUP", lane.group, "w", "COUNT", 1, "STREAMS", lane.stream, ">") as [
      string,
      [string, string[]][],
    ][];
    const [id] = reply[0]![1][0]!;
    const message: StreamMessage = {
      id,
      fields: { job_id: jobId, tenant, payload: JSON.stringify({ text: "A report.", notify: "ops@example.com" }) },
      deliveries: 6,
    };
    assert.equal(await failJob(db.sql, jobId, tenant, REASON), "failed");
    await deadLetter(r.redis, lane, message, REASON, markFailedHook);
    const dead = (await listDeadLetters(r.redis, lane)).find((d) => d.fields.job_id === jobId);
    return { jobId, message, deadId: dead!.id };
  };

  /** The effect counts of one job: its entries in the lane, dead letters, outcome rows and status record. */
  const effects = async (tenant: string, jobId: string) => {
    const lane = keys.lane(tenant);
    const ofJob = (entries: [string, string[]][]) =>
      entries.filter(([, flat]) => flat[flat.indexOf("job_id") + 1] === jobId).length;
    const outcomes = await db.sql<{ outcome: string }[]>`
      SELECT outcome FROM job_outcomes WHERE job_id = ${jobId}::uuid`;
    return {
      queued: ofJob(await r.redis.xrange(lane.stream, "-", "+")),
      dead: ofJob(await r.redis.xrange(lane.dead, "-", "+")),
      outcomes: outcomes.map((o) => o.outcome),
      status: await r.redis.hget(lane.job(jobId), "status"),
    };
  };
  const replayedOnce = { queued: 1, dead: 0, outcomes: [], status: "queued" };
  const replayed = (report: ReplayReport) => report.kind === "done" ? report.replayed : 0;

  try {
    await t.step("two replays of one dead letter at once: one replay, the job queued and undecided", async () => {
      const jobs = [];
      for (let i = 0; i < 20; i++) jobs.push(await deadJob("pairs"));
      await Promise.all(jobs.map(async (job) => {
        const target = { id: job.deadId, tenant: "pairs" };
        const reports = await Promise.all([
          replayDeadLetters({ redis: r.redis, sql: db.sql }, keys, target),
          replayDeadLetters({ redis: r.redis, sql: db.sql }, keys, target),
        ]);
        assert.equal(reports.map(replayed).reduce((a, b) => a + b), 1, "one of the two replayed it");
      }));
      for (const job of jobs) assert.deepEqual(await effects("pairs", job.jobId), replayedOnce, job.jobId);
    });

    await t.step("dlq replay --all run twice at once: each job queued once, none failed", async () => {
      const jobs = [];
      for (let i = 0; i < 10; i++) jobs.push(await deadJob("all"));
      const io = { out: () => {}, err: () => {} };
      const codes = await Promise.all([
        dlqCommand({ redis: r.redis, sql: db.sql }, keys, ["replay", "--all"], io),
        dlqCommand({ redis: r.redis, sql: db.sql }, keys, ["replay", "--all"], io),
      ]);
      assert.ok(codes.every((code) => code === 0 || code === 1), `exit codes ${codes}`);
      for (const job of jobs) assert.deepEqual(await effects("all", job.jobId), replayedOnce, job.jobId);
    });

    await t.step(
      "a replay that starts while another waits on Postgres is refused by name and changes nothing",
      async () => {
        const job = await deadJob("stalled");
        const target = { id: job.deadId, tenant: "stalled" };
        // Hold the job's outcome row: the first replay's reopen (its DELETE) waits for it.
        const held = await holdOutcomeRow(db.sql, job.jobId);
        const first = replayDeadLetters({ redis: r.redis, sql: db.sql }, keys, target);
        await waitFor("the first replay waiting on the row", async () => (await lockWaiters(db.sql)) === 1);
        const second = replayDeadLetters({ redis: r.redis, sql: db.sql }, keys, target);
        // Refused at once; a replay that went ahead instead would wait on the row as well.
        await Promise.race([second, waitFor("a second waiter", async () => (await lockWaiters(db.sql)) === 2)]);
        await held.release();
        const [one, two] = await Promise.all([first, second]);
        assert.deepEqual(await effects("stalled", job.jobId), replayedOnce);
        assert.equal(replayed(one), 1);
        assert.equal(replayed(two), 0);
        assert.ok(two.kind === "done" && two.refused === 1, JSON.stringify(two));
        assert.match(
          two.kind === "done" && !two.steps[0]!.replayed ? two.steps[0]!.message : "",
          new RegExp(`${job.deadId} \\(job ${job.jobId}, tenant stalled\\) is being replayed by another replay`),
        );
      },
    );

    await t.step("a replay whose script ran though its caller heard an error is asked again: one replay", async () => {
      const job = await deadJob("errored");
      const target = { id: job.deadId, tenant: "errored" };
      // The claim's reply arrives; the replay script runs, and its caller hears an error (a reply lost with its
      // connection, or a command aborted behind it in a pipeline). Before, the replay stopped there, the job
      // reopened in Postgres but neither queued nor reported.
      let scripts = 0;
      const faulty = afterEachScript(r.redis, () => {
        scripts++;
        return scripts === 2 ? Promise.reject(new Error("Command aborted due to connection close")) : Promise.resolve();
      });
      const report = await replayDeadLetters({ redis: faulty, sql: db.sql }, keys, target);
      assert.deepEqual(await effects("errored", job.jobId), replayedOnce);
      assert.equal(replayed(report), 1, JSON.stringify(report));
    });

    await t.step("a replay whose scripts are resent after lost replies: one replay, the job queued", async () => {
      const job = await deadJob("resent");
      const target = { id: job.deadId, tenant: "resent" };
      const report = await replayDeadLetters({ redis: resendingRedis(r.redis), sql: db.sql }, keys, target);
      assert.deepEqual(await effects("resent", job.jobId), replayedOnce);
      assert.equal(replayed(report), 1, JSON.stringify(report));
    });

    await t.step(
      "a dead-lettering resent after its job was replayed changes nothing: the job stays queued",
      async () => {
        const job = await deadJob("late");
        const lane = keys.lane("late");
        const report = await replayDeadLetters({ redis: r.redis, sql: db.sql }, keys, {
          id: job.deadId,
          tenant: "late",
        });
        assert.equal(replayed(report), 1);
        // The worker's dead-letter step, sent again on a new connection after the replay ran.
        assert.equal(await deadLetter(r.redis, lane, job.message, REASON, markFailedHook), 0);
        assert.deepEqual(await effects("late", job.jobId), replayedOnce);
      },
    );
    await t.step("a dead letter trimmed while its replay holds it: nothing queued, the job failed again", async () => {
      const job = await deadJob("trimmed");
      const lane = keys.lane("trimmed");
      // The dead stream's bounds drop the entry right after the replay claimed it.
      const trimming = afterEachScript(r.redis, async (reply) => {
        if (reply === "ok") await r.redis.xdel(lane.dead, job.deadId);
      });
      const target = { id: job.deadId, tenant: "trimmed" };
      const report = await replayDeadLetters({ redis: trimming, sql: db.sql }, keys, target);
      assert.deepEqual(await effects("trimmed", job.jobId), {
        queued: 0,
        dead: 0,
        outcomes: ["failed"],
        status: "failed",
      });
      assert.equal(replayed(report), 0);
    });
  } finally {
    await r.close();
    await db.close();
  }
});

/** Locks `jobId`'s outcome row in a transaction of its own until `release`. */
async function holdOutcomeRow(sql: Sql, jobId: string): Promise<{ release(): Promise<void> }> {
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  let locked!: () => void;
  const isLocked = new Promise<void>((resolve) => (locked = resolve));
  const done = sql.begin(async (tx) => {
    await tx`SELECT 1 FROM job_outcomes WHERE job_id = ${jobId}::uuid FOR UPDATE`;
    locked();
    await released;
  });
  await isLocked;
  return {
    async release() {
      release();
      await done;
    },
  };
}

/** How many of this database's sessions wait for a row lock. */
async function lockWaiters(sql: Sql): Promise<number> {
  const [row] = await sql<{ n: number }[]>`
    SELECT count(*)::int AS n FROM pg_stat_activity
    WHERE datname = current_database() AND wait_event_type = 'Lock'`;
  return row!.n;
}
