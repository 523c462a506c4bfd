/**
 * What one model call is charged, against a tenant's budgets and in
 * `model_attempts.cost_usd`: the usage the provider reported; when it
 * reported none, the whole reservation if the call may have run (a timeout
 * or a dropped connection after the request was sent: the provider may well
 * bill it), and nothing if the provider answered with an error or the
 * request never left.
 */
import type { Completion } from "../llm/llm.ts";
import { statusOf } from "../retry/classify.ts";
import { costNanos, type ModelPrice } from "../llm/prices.ts";

/** Tokens of one call: reserved (the worst case) or charged. */
export interface CallTokens {
  prompt: number;
  completion: number;
}

/** How a call ended, as a permit's settle hears it. */
export interface CallEnd {
  value?: Completion;
  error?: unknown;
  /** The call never went out (the caller gave up before it). */
  notSent?: boolean;
}

/** A charge: the tokens, and whether they are the provider's count or the reservation kept for want of one. */
export interface Charge extends CallTokens {
  /** `reported`: the provider's usage; `reserved`: no usage, the call may have run; `none`: not billed. */
  basis: "reported" | "reserved" | "none";
}

const REFUSED = /ECONNREFUSED|connection refused/i;

/** Whether an error says the request never reached the provider (refused before anything was sent). */
function neverSent(error: unknown): boolean {
  for (let e: unknown = error, depth = 0; e instanceof Error && depth < 4; e = e.cause, depth++) {
    if (REFUSED.test(e.message) || REFUSED.test(String((e as { code?: unknown }).code ?? ""))) return true;
  }
  return false;
}

/** What a call that ended as `end` is charged, given its reservation. See the module's header. */
export function chargeOf(end: CallEnd, reserved: CallTokens): Charge {
  const usage = end.value?.usage;
  if (
    usage && Number.isFinite(usage.prompt_tokens) && Number.isFinite(usage.completion_tokens) &&
    usage.prompt_tokens >= 0 && usage.completion_tokens >= 0
  ) {
    return { prompt: usage.prompt_tokens, completion: usage.completion_tokens, basis: "reported" };
  }
  if (end.notSent) return { prompt: 0, completion: 0, basis: "none" };
  // An answer without usage still ran: charged in full, never free.
  if (end.error === undefined) return { ...reserved, basis: "reserved" };
  // The provider answered with an error status: it refused the call, so it did not bill it.
  if (statusOf(end.error) !== undefined || neverSent(end.error)) return { prompt: 0, completion: 0, basis: "none" };
  return { ...reserved, basis: "reserved" };
}

/** The charge's cost in nano-dollars at `price` (undefined without a price). */
export function chargeNanos(charge: CallTokens, price: ModelPrice | undefined, batch = false): number | undefined {
  return price === undefined ? undefined : costNanos(price, charge.prompt, charge.completion, batch);
}
