/** The q-quantile (0..1) of numbers, by nearest rank. */
export function quantile(values: number[], q: number): number {
  if (values.length === 0) return NaN;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))]!;
}

/** The median. */
export function median(values: number[]): number {
  return quantile(values, 0.5);
}

/** Rounds for display. */
export function fmt(n: number, digits = 0): string {
  if (!Number.isFinite(n)) return "n/a";
  return n.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
