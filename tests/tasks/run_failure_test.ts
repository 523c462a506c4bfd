/**
 * A run's failure and its notification are one decision: deciding it twice
 * (a worker that died between the decision and the dead-letter step, then a
 * later delivery deciding again) writes one run.failed row; a replay of the
 * dead letter that then completes adds the run.completed row, never a second
 * failure row; a summary job's failure writes no notification.
 */
import assert from "node:assert/strict";
import { commitResults, failRun, reopenFailedJob } from "../../src/runs/commit.ts";
import { createTestDatabase } from "../_support.ts";

Deno.test("a failed run is notified once, and a replayed run that completes once more", async () => {
  const db = await createTestDatabase();
  try {
    const runId = crypto.randomUUID();
    const run = {
      jobId: runId,
      tenant: "acme",
      task: "triage",
      version: 3,
      notify: { webhook: "https://h.example/x" },
    };
    const outbox = async () =>
      (await db.sql<{ dedupe_key: string; topic: string }[]>`SELECT dedupe_key, topic FROM outbox ORDER BY id`)
        .map((r) => r.dedupe_key);

    assert.equal(
      await failRun(db.sql, run, 'permanent: output_invalid: at "/a": broken', { summary: false }),
      "failed",
    );
    assert.equal(
      await failRun(db.sql, run, 'permanent: output_invalid: at "/a": broken', { summary: false }),
      "failed",
    );
    assert.deepEqual(await outbox(), [`run_failed_webhook:${runId}`]);
    const [failed] = await db.sql<{ task: string; version: number; payload: { error: string } }[]>`
      SELECT o.task, o.version, x.payload FROM job_outcomes o, outbox x WHERE o.job_id = ${runId}`;
    assert.deepEqual([failed!.task, failed!.version, failed!.payload.error], ["triage", 3, 'output_invalid: at "/a"']);

    // The failure notification does not count as the run's effect: a replay may still complete it. Unsent,
    // it is withdrawn with the decision, so a completed replay is not announced as failed after the fact.
    assert.equal(await reopenFailedJob(db.sql, runId), null);
    assert.deepEqual(await outbox(), []);
    const done = { ...run, input: { ticket: "x" }, output: { a: 1 }, model: "m" };
    assert.deepEqual([...await commitResults(db.sql, [done])], [runId]);
    assert.deepEqual([...await commitResults(db.sql, [done])], [], "committed once");
    assert.deepEqual(await outbox(), [`run_done_webhook:${runId}`]);
    assert.equal(await reopenFailedJob(db.sql, runId), "done");

    // A failure notice already sent stays sent: the replay's completion follows it.
    const sentRun = { ...run, jobId: crypto.randomUUID() };
    await failRun(db.sql, sentRun, "permanent: x", { summary: false });
    await db.sql`UPDATE outbox SET sent_at = now() WHERE dedupe_key = ${`run_failed_webhook:${sentRun.jobId}`}`;
    assert.equal(await reopenFailedJob(db.sql, sentRun.jobId), null);
    assert.ok((await outbox()).includes(`run_failed_webhook:${sentRun.jobId}`));

    const summaryJob = crypto.randomUUID();
    const summary = { jobId: summaryJob, tenant: "acme", task: "summarize", version: 1, notify: "a@b.co" };
    assert.equal(await failRun(db.sql, summary, "permanent: x", { summary: true }), "failed");
    assert.equal((await outbox()).length, 2, "a summary job's failure is not notified");
  } finally {
    await db.close();
  }
});
