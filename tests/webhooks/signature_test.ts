import assert from "node:assert/strict";
import { Buffer } from "node:buffer";
import { createHmac } from "node:crypto";
import { newWebhookSecret, signWebhook } from "../../src/webhooks/signature.ts";
import { verifyWebhook } from "./_receiver.ts";

const NOW = 1_750_000_000;

function headersFor(id: string, timestamp: number, signature: string): Headers {
  return new Headers({ "webhook-id": id, "webhook-timestamp": String(timestamp), "webhook-signature": signature });
}

async function signed(body: string, secrets: string[], timestamp = NOW) {
  const id = "msg_2hXkD9";
  return { id, headers: headersFor(id, timestamp, await signWebhook({ id, timestamp, body, secrets })) };
}

Deno.test("newWebhookSecret() is whsec_ and the base64 of 24 random bytes", () => {
  const a = newWebhookSecret();
  const b = newWebhookSecret();
  assert.match(a, /^whsec_[A-Za-z0-9+/]{32}$/);
  assert.equal(atob(a.slice("whsec_".length)).length, 24);
  assert.notEqual(a, b);
});

Deno.test("signWebhook() matches the Standard Webhooks test vector and node:crypto's HMAC", async () => {
  const secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
  const id = "msg_p5jXN8AQM9LWM0D4loKWxJek";
  const timestamp = 1614265330;
  const body = '{"test": 2432232314}';
  const independent = createHmac("sha256", Buffer.from(secret.slice(6), "base64"))
    .update(`${id}.${timestamp}.${body}`)
    .digest("base64");
  const signature = await signWebhook({ id, timestamp, body, secrets: [secret] });
  assert.equal(signature, `v1,${independent}`);
  assert.equal(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
});

Deno.test("a signed webhook verifies with the receiver's code", async () => {
  const secret = newWebhookSecret();
  const body = JSON.stringify({ job_id: "j1", status: "done" });
  const { headers } = await signed(body, [secret]);
  assert.ok(await verifyWebhook({ headers, body, secret, nowSeconds: NOW + 10 }));
});

Deno.test("a tampered body fails verification", async () => {
  const secret = newWebhookSecret();
  const { headers } = await signed('{"amount":1}', [secret]);
  assert.equal(await verifyWebhook({ headers, body: '{"amount":100}', secret, nowSeconds: NOW }), false);
});

Deno.test("a signature made with another secret fails verification", async () => {
  const body = '{"amount":1}';
  const { headers } = await signed(body, [newWebhookSecret()]);
  assert.equal(await verifyWebhook({ headers, body, secret: newWebhookSecret(), nowSeconds: NOW }), false);
});

Deno.test("a timestamp older or newer than five minutes fails verification (replay)", async () => {
  const secret = newWebhookSecret();
  const body = "{}";
  const { headers } = await signed(body, [secret]);
  assert.ok(await verifyWebhook({ headers, body, secret, nowSeconds: NOW + 300 }));
  assert.equal(await verifyWebhook({ headers, body, secret, nowSeconds: NOW + 301 }), false);
  assert.equal(await verifyWebhook({ headers, body, secret, nowSeconds: NOW - 301 }), false);
});

Deno.test("during a rotation the header carries one signature per secret and either verifies", async () => {
  const [oldSecret, newSecret] = [newWebhookSecret(), newWebhookSecret()];
  const body = '{"x":1}';
  const { headers } = await signed(body, [newSecret, oldSecret]);
  assert.match(headers.get("webhook-signature")!, /^v1,[A-Za-z0-9+/]{43}= v1,[A-Za-z0-9+/]{43}=$/);
  assert.ok(await verifyWebhook({ headers, body, secret: oldSecret, nowSeconds: NOW }));
  assert.ok(await verifyWebhook({ headers, body, secret: newSecret, nowSeconds: NOW }));
});

Deno.test("signWebhook() refuses no secrets or a malformed one without quoting it", async () => {
  await assert.rejects(signWebhook({ id: "m", timestamp: NOW, body: "{}", secrets: [] }), TypeError);
  await assert.rejects(
    signWebhook({ id: "m", timestamp: NOW, body: "{}", secrets: ["whsec_not*base64!"] }),
    (error) => {
      assert.ok(error instanceof TypeError);
      assert.doesNotMatch(error.message, /not\*base64/);
      return true;
    },
  );
});
