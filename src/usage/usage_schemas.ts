/** The body of `GET /v1/usage`. */
import { z } from "zod";
import { BudgetView } from "../budgets/budget_view.ts";

const Tokens = z.object({ prompt: z.number().int(), completion: z.number().int() });

/** Calls, tokens, cost and cache hits of some of a tenant's runs. */
export const UsageFigures = z.object({
  calls: z.number().int().describe("Model calls (attempts), failed ones included"),
  failures: z.number().int().describe("Calls that did not answer"),
  tokens: Tokens.describe("As the provider reported them"),
  cost_usd: z.number().nullable().describe(
    "What the calls were charged at the model's price (LLM_PRICES): the reported usage, or the reservation of a " +
      "call that timed out after it was sent; null when none had a price",
  ),
  unpriced_calls: z.number().int().describe("Calls whose model had no price, left out of cost_usd"),
  batch_calls: z.number().int().describe(
    "Of the calls, those made through a provider batch (priority batch), charged at the model's batch prices",
  ),
  cache_hits: z.number().int().describe("Runs answered from the result cache, with no model call"),
  saved: z.object({
    tokens: Tokens,
    cost_usd: z.number().nullable().describe("Null when no hit's source run had a price"),
  }).describe("What the cache hits would have cost: the tokens and cost of the runs whose output they reused"),
});
export type UsageFigures = z.infer<typeof UsageFigures>;

/** Body of `GET /v1/usage`. */
export const UsageDocument = z.object({
  since: z.string().describe("The window asked for, such as 24h"),
  from: z.iso.datetime().describe("The start of the window"),
  totals: UsageFigures,
  by_task: z.array(z.object({ task: z.string(), version: z.number().int().min(1) }).extend(UsageFigures.shape))
    .describe("Per task version (a summary job is a run of summarize, version 1)"),
  by_model: z.array(z.object({ model: z.string().nullable() }).extend(UsageFigures.shape)),
  budgets: z.array(BudgetView).describe("The tenant's budgets; empty when it has none"),
});
export type UsageDocument = z.infer<typeof UsageDocument>;
