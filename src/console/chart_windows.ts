/**
 * The time windows of the console's charts. Buckets sit on the UTC clock:
 * each starts at a whole multiple of its width since the epoch (a minute,
 * an hour, 6 hours), and the last is the one in progress, so a bar means the
 * same span whenever the page is loaded and no bucket spans midnight. The
 * usage page and a task's page offer the same three windows
 * (`?window=1h|24h|7d`) and link to the others.
 */
import type { Window } from "../jobs/usage_series.ts";
import type { Bucket } from "./charts.ts";
import { type Html, html } from "./html.ts";
import { page, type View } from "./layout.ts";

const MINUTE_MS = 60_000, HOUR_MS = 3_600_000, DAY_MS = 86_400_000;

/**
 * `count` buckets of `widthMs` on the UTC clock, the last holding `nowMs`. `widthMs` must divide a day, so that
 * buckets start on the clock's minutes and hours and each lies within one UTC day. Labels are the bucket's start,
 * `14:05`, with the date (`12-01 18:00`) when the window spans more than a day.
 */
export function clockWindow(nowMs: number, widthMs: number, count: number): { window: Window; buckets: Bucket[] } {
  const fromMs = (Math.floor(nowMs / widthMs) - count + 1) * widthMs;
  const dated = widthMs * count > DAY_MS;
  const buckets = Array.from({ length: count }, (_, i) => {
    const startMs = fromMs + i * widthMs;
    const iso = new Date(startMs).toISOString();
    return {
      startMs,
      endMs: startMs + widthMs,
      label: dated ? `${iso.slice(5, 10)} ${iso.slice(11, 16)}` : iso.slice(11, 16),
    };
  });
  return { window: { fromMs, widthMs, count }, buckets };
}

/** A window the usage charts offer, and how its pages name it. */
export interface UsageWindow {
  /** The `window` query parameter. */
  name: "1h" | "24h" | "7d";
  widthMs: number;
  count: number;
  /** One bucket, after "per": `minute`, `hour`, `6 hours`. */
  unit: string;
  /** The window in a sentence: `the last 24 hours`. */
  span: string;
  /** The x axis. */
  xLabel: string;
  /** Label the buckets that start at a multiple of this many widths (7 d: midnights). */
  labelEvery?: number;
  /** Its link in the switch. */
  choice: string;
}

/**
 * The three windows. 7 days are 28 buckets of 6 hours rather than 168 hourly ones: at the chart's width an
 * hourly bar would be 4 pixels (2 for each of calls and 429s side by side), too thin to read or to point at for
 * its title, while 6 hours starting at 00, 06, 12 and 18 UTC still show the day's rhythm and fit 4 to a UTC day,
 * so the day's running total starts afresh on a bar's edge. The hours are a click away in the 24-hour window.
 */
export const USAGE_WINDOWS: readonly UsageWindow[] = [
  {
    name: "1h",
    widthMs: MINUTE_MS,
    count: 60,
    unit: "minute",
    span: "the last hour",
    xLabel: "UTC minute",
    choice: "1 hour, per minute",
  },
  {
    name: "24h",
    widthMs: HOUR_MS,
    count: 24,
    unit: "hour",
    span: "the last 24 hours",
    xLabel: "UTC hour",
    choice: "24 hours, per hour",
  },
  {
    name: "7d",
    widthMs: 6 * HOUR_MS,
    count: 28,
    unit: "6 hours",
    span: "the last 7 days",
    xLabel: "UTC date and hour, 6 hours a bucket",
    labelEvery: 4,
    choice: "7 days, per 6 hours",
  },
];

/** The window a usage page shows without `?window=`. */
export const DEFAULT_USAGE_WINDOW = "24h";

/** The window `name` (the default when unset); undefined for any other value. */
export function usageWindow(name: string | undefined): UsageWindow | undefined {
  return USAGE_WINDOWS.find((w) => w.name === (name ?? DEFAULT_USAGE_WINDOW));
}

/**
 * Links to `path` in each window but `current` (plain text), keeping `params` (a tenant, a version) in the
 * query: `/console/usage?tenant=acme&window=7d`.
 */
export function windowSwitch(path: string, params: Record<string, string | undefined>, current?: UsageWindow): Html {
  const kept = Object.entries(params).filter((p): p is [string, string] => p[1] !== undefined);
  const choices = USAGE_WINDOWS.map((w, i) => {
    const query = new URLSearchParams([...kept, ["window", w.name]]);
    const choice = w === current
      ? html`<strong>${w.choice}</strong>`
      : html`<a href="${path}?${query.toString()}" data-window="${w.name}">${w.choice}</a>`;
    return i === 0 ? choice : html`
      · ${choice}
    `;
  });
  return html`<p class="switch">${choices}</p>`;
}

/** The answer to a `window` no page offers: `400`, naming it, with the links to the windows there are. */
export function unknownWindow(
  view: View,
  title: string,
  path: string,
  params: Record<string, string | undefined>,
  name: string,
): Response {
  const body = html`<p>Not a window: <code>${name}</code>. The windows are:</p>${windowSwitch(path, params)}`;
  return page(view, title, body, { status: 400 });
}
