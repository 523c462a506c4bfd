/**
 * Charts drawn on the server as inline SVG: bars and lines over time
 * buckets, a y axis scaled to round steps, and a limit (a budget) as a
 * dashed line with its value. No script and no `style` attribute, only
 * presentation attributes, so the console's Content-Security-Policy stays as
 * it is. Every chart names itself (`<title>`, `<desc>`), every bar and point
 * carries its figure (`<title>` and `data-value`), and a table of the same
 * figures follows it. Text from data is escaped by the `html` tag.
 */
import { type Html, html } from "./html.ts";
import { table } from "./layout.ts";

/** One bucket of the x axis. */
export interface Bucket {
  startMs: number;
  endMs: number;
  /** Its label on the axis (`14:05`). */
  label: string;
}

/** A series of figures, one per bucket; null where it has none (a line breaks there). */
export interface ChartSeries {
  /** `data-series` of its marks. */
  key: string;
  /** Its name in the legend and the table. */
  name: string;
  kind: "bar" | "line";
  values: readonly (number | null)[];
  color: string;
  /** Where a line's points sit: the bucket's middle, or its end (a running total up to it). */
  at?: "middle" | "end";
  /** Where a line starts afresh instead of joining the point before (a running total after midnight). */
  restarts?: readonly boolean[];
}

/** What a chart shows. */
export interface ChartSpec {
  /** The element's id; its title and description are `ID-title` and `ID-desc`. */
  id: string;
  title: string;
  desc: string;
  buckets: readonly Bucket[];
  series: readonly ChartSeries[];
  /** Bars of one bucket on top of each other instead of side by side. */
  stacked?: boolean;
  yLabel: string;
  xLabel: string;
  /** A figure for people: on the axis, in titles and in the table. */
  format: (value: number) => string;
  /** A limit drawn across as a dashed line, labelled with its value (a budget). */
  limit?: { value: number; label: string };
  /**
   * Label the buckets that start at a multiple of n bucket widths since the epoch (default: about 12 labels), so
   * that labels fall on round times of the clock (every 5 minutes, every other hour) wherever the window starts.
   */
  labelEvery?: number;
}

const WIDTH = 760, HEIGHT = 260;
const MARGIN = { left: 70, right: 16, top: 34, bottom: 46 };
const PLOT_W = WIDTH - MARGIN.left - MARGIN.right, PLOT_H = HEIGHT - MARGIN.top - MARGIN.bottom;
const LIMIT_COLOR = "#c0392b";

/** A round step (1, 2 or 5 times a power of ten) at least `rough`. */
export function niceStep(rough: number): number {
  if (!(rough > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(rough));
  const f = rough / power;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * power;
}

/** The y axis for values up to `max`: round ticks from 0, the last at or above `max`. */
export function yTicks(max: number, count = 4): number[] {
  const step = niceStep(max / count);
  const top = Math.max(1, Math.ceil(max / step - 1e-9)) * step;
  const ticks: number[] = [];
  for (let i = 0; i * step <= top + step / 2; i++) ticks.push(Number((i * step).toPrecision(12)));
  return ticks;
}

/** Two decimals at most, for coordinates. */
const c = (n: number) => Number(n.toFixed(2));

/** A bucket as its title names it: `2026-12-01 13:05–14:05 UTC`. */
export function bucketRange(b: Bucket): string {
  const start = new Date(b.startMs).toISOString();
  return `${start.slice(0, 10)} ${start.slice(11, 16)}–${new Date(b.endMs).toISOString().slice(11, 16)} UTC`;
}

/** The chart as an inline `<svg>` in a `<figure>`, with its figures in a table below. */
export function chart(spec: ChartSpec): Html {
  const { id, buckets, series, format, limit } = spec;
  const n = Math.max(buckets.length, 1);
  const bars = series.filter((s) => s.kind === "bar");
  const lines = series.filter((s) => s.kind === "line");
  const barTotals = buckets.map((_, i) =>
    spec.stacked
      ? bars.reduce((sum, s) => sum + Math.max(0, s.values[i] ?? 0), 0)
      : Math.max(0, ...bars.map((s) => s.values[i] ?? 0))
  );
  const lineValues = lines.flatMap((s) => s.values.filter((v): v is number => v !== null));
  const ticks = yTicks(Math.max(0, ...barTotals, ...lineValues, limit?.value ?? 0));
  const top = ticks.at(-1)!;
  const y = (v: number) => c(MARGIN.top + PLOT_H - (Math.max(0, v) / top) * PLOT_H);
  const slot = PLOT_W / n;
  const x0 = (i: number) => MARGIN.left + i * slot;
  const every = spec.labelEvery ?? Math.max(1, Math.ceil(n / 12));
  const titleOf = (s: ChartSeries, i: number, v: number | null) =>
    `${bucketRange(buckets[i]!)}: ${s.name} ${v === null ? "none" : format(v)}`;
  const mark = (s: ChartSeries, i: number, v: number | null) =>
    html`data-series="${s.key}" data-bucket="${new Date(buckets[i]!.startMs).toISOString()}" data-value="${
      v === null ? "" : String(v)
    }"`;

  const grid = ticks.map((t) =>
    html`
      <line x1="${MARGIN.left}" x2="${WIDTH - MARGIN.right}" y1="${y(t)}" y2="${y(t)}" stroke="${t === 0
        ? "#8a94a3"
        : "#e3e6ea"}" />
      <text x="${MARGIN.left - 6}" y="${y(t) + 4}" text-anchor="end">${format(t)}</text>
    `
  );
  const xLabels = buckets.map((b, i) =>
    Math.round(b.startMs / (b.endMs - b.startMs)) % every === 0
      ? html`<text x="${c(x0(i) + slot / 2)}" y="${MARGIN.top + PLOT_H + 16}" text-anchor="middle">${b.label}</text>`
      : ""
  );
  const inner = slot * 0.8;
  const barMarks = buckets.map((_, i) => {
    let stackedTo = 0;
    return bars.map((s, k) => {
      const v = s.values[i] ?? null;
      const h = Math.max(0, v ?? 0);
      const width = spec.stacked ? inner : inner / bars.length;
      const left = x0(i) + slot * 0.1 + (spec.stacked ? 0 : k * width);
      const bottom = spec.stacked ? stackedTo : 0;
      stackedTo += h;
      return html`
        <rect ${mark(s, i, v)} x="${c(left)}" y="${y(bottom + h)}" width="${c(Math.max(width - 1, 1))}"
          height="${c(y(bottom) - y(bottom + h))}" fill="${s.color}">
          <title>${titleOf(s, i, v)}</title>
        </rect>
      `;
    });
  });
  const lineMarks = lines.map((s) => {
    const px = (i: number) => c(s.at === "end" ? x0(i + 1) : x0(i) + slot / 2);
    let path = "", pen = "M";
    s.values.forEach((v, i) => {
      if (s.restarts?.[i]) pen = "M";
      if (v === null) pen = "M";
      else (path += `${pen}${px(i)} ${y(v)} `), (pen = "L");
    });
    const points = s.values.map((v, i) =>
      v === null ? "" : html`
        <circle ${mark(s, i, v)} cx="${px(i)}" cy="${y(v)}" r="${n > 30 ? 2 : 3}" fill="${s.color}"
        >
          <title>${titleOf(s, i, v)}</title>
        </circle>
      `
    );
    return html`
      <path d="${path.trim()}" fill="none" stroke="${s.color}" stroke-width="2" />${points}
    `;
  });
  const limitMark = limit
    ? html`
      <line data-limit="${String(limit.value)}" x1="${MARGIN.left}" x2="${WIDTH - MARGIN.right}" y1="${y(
        limit.value,
      )}" y2="${y(limit.value)}" stroke="${LIMIT_COLOR}"
        stroke-width="1.5" stroke-dasharray="6 4">
        <title>${limit.label}: ${format(limit.value)}</title>
      </line>
      <text x="${WIDTH - MARGIN.right - 4}" y="${y(limit.value) - 5}" text-anchor="end" fill="${LIMIT_COLOR}">${limit
        .label}: ${format(limit.value)}</text>
    `
    : "";
  // The legend along the top: a swatch and a name for each series, then the limit.
  let lx = MARGIN.left;
  const legend = [
    ...series.map((s) => {
      const at = lx;
      lx += 26 + s.name.length * 6.5;
      const swatch = s.kind === "bar"
        ? html`
          <rect x="${at}" y="10" width="12" height="10" fill="${s.color}" />
        `
        : html`
          <line x1="${at}" x2="${at + 14}" y1="15" y2="15" stroke="${s.color}" stroke-width="2" />
        `;
      return html`${swatch}<text x="${at + 18}" y="19">${s.name}</text>`;
    }),
    limit
      ? html`
        <line x1="${lx}" x2="${lx + 14}" y1="15" y2="15" stroke="${LIMIT_COLOR}" stroke-width="1.5"
          stroke-dasharray="4 3" />
        <text x="${lx + 18}" y="19">${limit.label}</text>
      `
      : "",
  ];

  const svg = html`
    <svg xmlns="http://www.w3.org/2000/svg" id="${id}" class="chart" viewBox="0 0 ${WIDTH} ${HEIGHT}"
      role="img" aria-labelledby="${id}-title ${id}-desc" font-family="system-ui, sans-serif" font-size="11"
      fill="#1b1f24"><title id="${id}-title">${spec.title}</title><desc id="${id}-desc">${spec.desc}</desc>
        <rect x="0" y="0" width="${WIDTH}" height="${HEIGHT}" fill="#fff"/>${legend}${grid}${xLabels}${barMarks}${lineMarks}${limitMark}
        <text x="${MARGIN.left + PLOT_W / 2}" y="${HEIGHT - 6}" text-anchor="middle" fill="#556">${spec.xLabel}</text>
        <text transform="translate(14 ${MARGIN.top + PLOT_H / 2}) rotate(-90)" text-anchor="middle" fill="#556">${spec
          .yLabel}</text>
      </svg>
  `;
  const rows = buckets.map((b, i) => [
    html`${bucketRange(b)}`,
    ...series.map((s) => html`${s.values[i] === null ? "" : format(s.values[i]!)}`),
  ]);
  return html`<figure class="plot" id="${id}-figure"><figcaption>${spec.title}</figcaption>${svg}
    <details><summary>Figures</summary>${
    table(["bucket", ...series.map((s) => s.name)], rows, "No buckets.")
  }</details></figure>`;
}

const COUNT = new Intl.NumberFormat("en-US", { maximumFractionDigits: 2 });

/** A count or token figure: `12,345`. */
export function formatCount(n: number): string {
  return COUNT.format(n);
}

/** USD: `$12.35`, small amounts to four significant digits (`$0.001234`). */
export function formatUsd(n: number): string {
  if (n === 0) return "$0";
  if (Math.abs(n) >= 1) return `$${n.toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 })}`;
  const rounded = Number(n.toPrecision(4));
  // Below a millionth, String() would write `1e-7`.
  return `$${Math.abs(rounded) < 1e-6 ? rounded.toFixed(12).replace(/0+$/, "") : String(rounded)}`;
}

/** A latency: `850 ms`, `2.5 s`. */
export function formatMs(ms: number): string {
  return ms < 1000 ? `${Number(ms.toFixed(1))} ms` : `${Number((ms / 1000).toFixed(2))} s`;
}
