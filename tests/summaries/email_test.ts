import assert from "node:assert/strict";
import { commitResults } from "../../src/runs/commit.ts";
import { EMAIL_SUMMARY_MAX_CHARS, summaryEmailRenderer, summaryPayloadLoader } from "../../src/summaries/email.ts";
import { createTestDatabase } from "../_support.ts";

Deno.test("the outbox row references the summary, and the email carries at most an excerpt of it", async () => {
  const db = await createTestDatabase();
  try {
    const jobId = crypto.randomUUID();
    const long = "The quarter went well. ".repeat(400); // about 9,200 characters
    await commitResults(db.sql, [{ jobId, tenant: "acme", summary: long, notify: "ops@example.com" }]);
    const [row] = await db.sql<{ payload: Record<string, unknown> }[]>`SELECT payload FROM outbox`;
    assert.deepEqual(row!.payload, { job_id: jobId, tenant: "acme", to: "ops@example.com" }, "no second copy");
    const claimed = [{
      id: "1",
      topic: "email.summary_ready",
      dedupe_key: "k",
      payload: row!.payload,
      attempts: 0,
      claim_token: "t",
    }];
    await summaryPayloadLoader(db.sql)(claimed);
    const email = summaryEmailRenderer("s@example.com")(claimed[0]!.topic, claimed[0]!.payload);
    assert.ok(email.text.length < EMAIL_SUMMARY_MAX_CHARS + 300, `email of ${email.text.length} characters`);
    assert.match(email.text, /The quarter went well\./);
    assert.match(email.text, /whole summary is at the address below/);
    // A short summary is sent whole; a row from before references keeps its own copy.
    const short = summaryEmailRenderer("s@example.com")("email.summary_ready", {
      job_id: jobId,
      to: "a@b.co",
      summary: "Short.",
    });
    assert.match(short.text, /summary:\n\nShort\.\n\n/);
  } finally {
    await db.close();
  }
});
