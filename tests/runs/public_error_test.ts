import assert from "node:assert/strict";
import { publicError } from "../../src/runs/public_error.ts";

Deno.test("publicError() passes on only the worker's own labels, never a provider's or a database's text", () => {
  const ours = "exceeded 3 deliveries: 6 model calls failed (AttemptTimeout ×4, http_500 ×2), while the provider " +
    "served other jobs";
  assert.equal(publicError(ours), ours);
  assert.equal(publicError("exceeded 5 deliveries"), "exceeded 5 deliveries");
  // Anything else in that shape (a host name, a message) falls back to the class.
  assert.equal(publicError("exceeded 3 deliveries: 1 model call failed (gw.internal.corp ×1)"), "failed");
  assert.equal(publicError("permanent: UpstreamHttpError: Upstream answered 400: {secret}"), "model_rejected: 400");
  assert.equal(publicError("permanent: the summary cannot be stored: invalid byte sequence"), "storage_rejected");
  assert.equal(publicError("anything at all"), "failed");
});

Deno.test("a failed run's error names the pointer into the answer, shortened when long", () => {
  assert.equal(
    publicError('permanent: output_invalid: at "/a/0": the answer does not match'),
    'output_invalid: at "/a/0"',
  );
  const long = "/x".repeat(150);
  assert.equal(
    publicError(`permanent: output_invalid: at "${long}": the answer does not match`),
    `output_invalid: at "${long.slice(0, 200)}…"`,
  );
});
