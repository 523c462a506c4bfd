/** What a provider's `x-ratelimit-*` headers said about one API key, as OpenAI sends them. */
export interface RateLimitHeaders {
  /** Requests per minute allowed (`x-ratelimit-limit-requests`). */
  limitRequests?: number;
  /** Tokens per minute allowed (`x-ratelimit-limit-tokens`). */
  limitTokens?: number;
  remainingRequests?: number;
  remainingTokens?: number;
  /** Milliseconds until the request budget is whole again (`x-ratelimit-reset-requests`). */
  resetRequestsMs?: number;
  /** Milliseconds until the token budget is whole again (`x-ratelimit-reset-tokens`). */
  resetTokensMs?: number;
}

const UNITS: Record<string, number> = { h: 3_600_000, m: 60_000, s: 1_000, ms: 1 };

/**
 * Parses a reset duration as OpenAI writes it (`1s`, `6m0s`, `20ms`,
 * `1h2m3.5s`), or a bare number of seconds.
 * @returns milliseconds, or undefined when the value is not a duration.
 */
export function parseResetDuration(value: string): number | undefined {
  const text = value.trim();
  if (/^\d+(\.\d+)?$/.test(text)) return Number(text) * 1000;
  if (!/^(\d+(\.\d+)?(ms|h|m|s))+$/.test(text)) return undefined;
  let total = 0;
  for (const [, amount, unit] of text.matchAll(/(\d+(?:\.\d+)?)(ms|h|m|s)/g)) total += Number(amount) * UNITS[unit!]!;
  return total;
}

function count(headers: Headers, name: string): number | undefined {
  const value = headers.get(name)?.trim();
  return value !== undefined && /^\d+$/.test(value) ? Number(value) : undefined;
}

function duration(headers: Headers, name: string): number | undefined {
  const value = headers.get(name);
  return value === null ? undefined : parseResetDuration(value);
}

/** Reads the `x-ratelimit-*` headers; a missing or malformed header is left undefined. */
export function parseRateLimitHeaders(headers: Headers): RateLimitHeaders {
  return {
    limitRequests: count(headers, "x-ratelimit-limit-requests"),
    limitTokens: count(headers, "x-ratelimit-limit-tokens"),
    remainingRequests: count(headers, "x-ratelimit-remaining-requests"),
    remainingTokens: count(headers, "x-ratelimit-remaining-tokens"),
    resetRequestsMs: duration(headers, "x-ratelimit-reset-requests"),
    resetTokensMs: duration(headers, "x-ratelimit-reset-tokens"),
  };
}
