/** One label of the worker's own failure summary: a status or an error class, and a count. */
const LABEL = String.raw`(?:http_\d{3}|[A-Za-z]+) ×\d+`;
/** The worker's own reason for giving up on a job (`describeFailures`), and nothing else. */
const GAVE_UP = new RegExp(
  String.raw`^exceeded \d+ deliveries(: \d+ model calls? failed \(${LABEL}(, ${LABEL})*\)` +
    String.raw`(, while the provider served other jobs)?)?$`,
);

/**
 * What a tenant is told about a failed job: a stable class, never the
 * provider's or the database's own text, which may name keys, hosts or
 * internals. Operators see the whole reason in the logs, `dlq list` and
 * `job_outcomes.error`.
 */
export function publicError(reason: string): string {
  const status = /Upstream answered (\d{3})/.exec(reason)?.[1];
  if (status) return `model_rejected: ${status}`;
  if (reason.includes("cannot be stored")) return "storage_rejected";
  // The worker's own words about the tenant's schema and the pointer into the answer: no provider text.
  const invalid = /output_invalid: at "([^"]*)"/.exec(reason);
  if (invalid) {
    const pointer = invalid[1]!;
    return `output_invalid: at "${pointer.length > 200 ? `${pointer.slice(0, 200)}…` : pointer}"`;
  }
  if (/GateRefused|tokens-per-minute limit|request too large/i.test(reason)) return "too_large";
  if (/\bAnswerTooLarge\b/.test(reason)) return "answer_too_large";
  if (/malformed job (payload|message)/.test(reason)) return "malformed_job";
  // Built by the worker from labels alone (error classes, statuses): nothing of the provider's text.
  const gaveUp = GAVE_UP.exec(reason);
  if (gaveUp) return gaveUp[0];
  return "failed";
}
