/** The typed client's webhook verifier refuses a clock or tolerance that is not a number (issue 37). */
import assert from "node:assert/strict";
import { verifyWebhook } from "../../src/client/client.ts";
import { signWebhook } from "../../src/webhooks/signature.ts";

Deno.test("verifyWebhook refuses a NaN now or tolerance instead of accepting any timestamp", async () => {
  const secret = `whsec_${btoa("a secret of 24 bytes!!!!")}`;
  const body = JSON.stringify({ type: "run.completed", status: "done" });
  // Signed ten years ago: no tolerance a number allows would accept it.
  const timestamp = Math.floor(Date.now() / 1000) - 10 * 365 * 86_400;
  const id = "run_completed:1";
  const headers = {
    "webhook-id": id,
    "webhook-timestamp": String(timestamp),
    "webhook-signature": await signWebhook({ id, timestamp, body, secrets: [secret] }),
  };
  for (const options of [{ now: NaN }, { toleranceS: NaN }, { now: new Date("not a date") }, { toleranceS: -1 }]) {
    await assert.rejects(verifyWebhook({ secret, headers, body, ...options }), TypeError, JSON.stringify(options));
  }
  await assert.rejects(verifyWebhook({ secret, headers, body }), /past, over the 300 s tolerance/);
});
