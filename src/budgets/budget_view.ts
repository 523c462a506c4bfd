/** One budget as `GET /v1/usage`, `tenant list` and the console show it: its one definition (the usage document's schema includes it). */
import { z } from "zod";

/** A tenant's budget as the usage report shows it: its limit, what is spent and reserved, and when it resets. */
export const BudgetView = z.object({
  period: z.enum(["day", "month"]).describe("A UTC day or a UTC month"),
  unit: z.enum(["usd", "tokens"]),
  limit: z.number().min(0),
  spent: z.number().min(0).describe("Charged in this period so far"),
  reserved: z.number().min(0).describe("Held by calls in flight (their worst case), settled when they end"),
  resets_at: z.iso.datetime().describe("When the period ends"),
});
export type BudgetView = z.infer<typeof BudgetView>;
