/**
 * The types the relay (`relay.ts`) and its private parts (`_delivery.ts`,
 * `_run_loop.ts`) share: a leased row and the hooks a relay is built with.
 * `relay.ts` exports them; import them from there.
 */
import type { Email } from "../mail/mailer.ts";
import type { ClaimedRow, OutboxRow } from "./outbox_store.ts";

/** A row this relay claimed, with when its lease ends on the relay's clock (`now`; never later than in Postgres). */
export interface LeasedRow extends ClaimedRow {
  leaseEndsMs: number;
}

/** Turns an outbox row into the email to send. @throws for a topic it does not know (a permanent failure). */
export type Renderer = (topic: string, payload: Record<string, unknown>) => Email;

/**
 * Delivers a row of a topic that is not an email (a webhook). Throws like a
 * mailer: a retryable error is retried with backoff, anything else fails the
 * row. The row's dedupe key is its idempotency key at the receiver.
 */
export type OutboxSender = (row: OutboxRow, signal: AbortSignal) => Promise<{ providerId?: string }>;

/**
 * Completes claimed rows' payloads with what the renderer needs and the row
 * only references (one query for the whole claim), before any is rendered.
 */
export type PayloadLoader = (rows: OutboxRow[]) => Promise<void>;

/**
 * Decides which claimed rows must wait (a rate limit): returns each such
 * row's id with how long it waits. A deferred row is released without
 * counting an attempt.
 */
export type Deferral = (rows: OutboxRow[]) => Promise<Map<string, number>>;

/** Counters a relay reports; wire them to metrics. */
export interface RelayEvents {
  sent?(row: OutboxRow, durationMs: number): void;
  retry?(row: OutboxRow, reason: string): void;
  failed?(row: OutboxRow, reason: string): void;
}
