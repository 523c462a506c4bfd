/**
 * The window of a usage report: `24h`, `7d`, `30m`, `90s`, as `deno task usage --since` and
 * `GET /v1/usage?since=` take it.
 */

const UNITS: Record<string, number> = { s: 1, m: 60, h: 3600, d: 86400 };

/** The window when none is given. */
export const DEFAULT_SINCE = "24h";

/** The longest window: 400 days, past any retention of `model_attempts` worth reading. */
export const MAX_SINCE_S = 400 * 86_400;

/**
 * Parses `24h`, `7d`, `30m`, `90s` into seconds (1 s to {@linkcode MAX_SINCE_S}).
 * @throws {TypeError} naming the value for anything else.
 */
export function parseSince(text: string): number {
  const match = /^(\d{1,9})([smhd])$/.exec(text);
  if (!match) throw new TypeError(`since takes a number and a unit, such as 24h, 7d, 30m or 90s (got "${text}")`);
  const seconds = Number(match[1]) * UNITS[match[2]!]!;
  if (seconds < 1 || seconds > MAX_SINCE_S) {
    throw new TypeError(`since must be from 1s to ${MAX_SINCE_S / 86_400}d (got "${text}")`);
  }
  return seconds;
}
