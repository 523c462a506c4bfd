/** Prints rows as an aligned text table, or as JSON lines with `json`. */
export function printRows(
  rows: Record<string, unknown>[],
  { json = false, out = console.log, empty = "(none)" }: {
    json?: boolean;
    out?: (line: string) => void;
    empty?: string;
  } = {},
): void {
  if (json) {
    for (const row of rows) out(JSON.stringify(row));
    return;
  }
  if (rows.length === 0) {
    out(empty);
    return;
  }
  const columns = Object.keys(rows[0]!);
  // A provider's error body ends up here: control characters (ESC, CR, ...) would drive the terminal.
  const cell = (v: unknown) =>
    v === null || v === undefined ? "" : String(v).replace(/\p{Cc}/gu, (c) => (c === "\n" ? " " : "?"));
  const widths = columns.map((c) => Math.max(c.length, ...rows.map((r) => Math.min(cell(r[c]).length, 60))));
  const line = (values: string[]) =>
    values.map((v, i) => (v.length > 60 ? v.slice(0, 57) + "..." : v).padEnd(widths[i]!)).join("  ").trimEnd();
  out(line(columns));
  for (const row of rows) out(line(columns.map((c) => cell(row[c]))));
}
