/** Reading the console's charts back out of a page: each mark's bucket and figure, and the figures under them. */
import assert from "node:assert/strict";

/** One bar or point of a chart. */
export interface Mark {
  /** Its bucket's start, as an ISO string. */
  bucket: string;
  /** Its `data-value`; null where the series has none. */
  value: number | null;
  /** Its `<title>`. */
  title: string;
}

/** The `<svg>` of chart `id` in a page. */
export function svgOf(body: string, id: string): string {
  const start = body.indexOf(`<svg xmlns="http://www.w3.org/2000/svg" id="${id}"`);
  assert.ok(start >= 0, `chart ${id} is on the page`);
  return body.slice(start, body.indexOf("</svg>", start));
}

/** The marks of chart `id` in a page: `data-series` → its marks, in bucket order. */
export function marksOf(body: string, id: string): Map<string, Mark[]> {
  const marks = new Map<string, Mark[]>();
  const re = /data-series="([^"]+)" data-bucket="([^"]+)" data-value="([^"]*)"[^>]*>\s*<title>([^<]*)<\/title>/g;
  for (const [, series, bucket, value, title] of svgOf(body, id).matchAll(re)) {
    const list = marks.get(series!) ?? [];
    list.push({ bucket: bucket!, value: value === "" ? null : Number(value), title: title! });
    marks.set(series!, list);
  }
  return marks;
}

/** The values of one series of a chart, one per bucket (bars) or per bucket with a point (lines). */
export function valuesOf(body: string, id: string, series: string): (number | null)[] {
  return (marksOf(body, id).get(series) ?? []).map((m) => m.value);
}

/** The text of the figure `<dd id="ID">` (the totals above the charts). */
export function figureOf(body: string, id: string): string | undefined {
  return new RegExp(`<dd id="${id}">([^<]*)</dd>`).exec(body)?.[1];
}
