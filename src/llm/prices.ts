/**
 * Model prices, in USD per million tokens: `LLM_PRICES` per model, else
 * `LLM_PRICE_IN_PER_MTOK` / `LLM_PRICE_OUT_PER_MTOK` for every model.
 *
 * Costs are counted in whole nano-dollars (1e-9 USD) so that budgets add up
 * exactly in Redis's Lua (whose numbers are doubles: integers are exact up to
 * 2^53 nano-dollars, about 9 million USD). A price is first turned into
 * pico-dollars per token (exact for prices with up to six decimals), and a
 * call's cost is rounded up to the next nano-dollar: a budget is never
 * undercharged.
 */

/** One model's prices, USD per million tokens; the batch prices are for the Batch API. */
export interface ModelPrice {
  in: number;
  out: number;
  batch_in?: number;
  batch_out?: number;
}

/** The price table: a model's price, or undefined when it has none. */
export interface Prices {
  of(model: string): ModelPrice | undefined;
  /** The models priced by name (empty when one default price covers every model). */
  readonly models: readonly string[];
  /** Whether every model has a price (LLM_PRICE_* set, LLM_PRICES unset). */
  readonly pricedByDefault: boolean;
}

const NANOS_PER_USD = 1e9;
const PRICE_KEYS = new Set(["in", "out", "batch_in", "batch_out"]);

/**
 * The models served here, and so the only ones a task or request may name. With `LLM_DEPLOYMENTS`, every model a
 * deployment lists (and those only). Without, the one deployment's: `OPENAI_MODEL` (or `extractive`, the embedded
 * model) and every model `LLM_PRICES` prices, so every model a run can use has a price of its own (the default model
 * the flat `LLM_PRICE_*_PER_MTOK` when `LLM_PRICES` does not name it).
 */
export function servedModels(
  config: {
    LLM_PROVIDER: string;
    OPENAI_MODEL: string;
    LLM_PRICES?: Record<string, ModelPrice>;
    LLM_DEPLOYMENTS?: readonly { models: readonly string[] }[];
  },
): ReadonlySet<string> {
  if (config.LLM_DEPLOYMENTS) return new Set(config.LLM_DEPLOYMENTS.flatMap((deployment) => deployment.models));
  return new Set([
    config.LLM_PROVIDER === "openai" ? config.OPENAI_MODEL : "extractive",
    ...Object.keys(config.LLM_PRICES ?? {}),
  ]);
}

/**
 * Parses `LLM_PRICES`.
 * @returns the table by model, or a message naming what is wrong.
 */
export function parsePrices(text: string): Record<string, ModelPrice> | string {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (error) {
    return `is not JSON (${(error as Error).message}); for example {"gpt-4.1-mini": {"in": 0.4, "out": 1.6}}`;
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    return `must be a JSON object of models, for example {"gpt-4.1-mini": {"in": 0.4, "out": 1.6}}`;
  }
  const table: Record<string, ModelPrice> = Object.create(null);
  for (const [model, price] of Object.entries(value)) {
    if (model.trim() === "") return "names a model with an empty name";
    if (typeof price !== "object" || price === null || Array.isArray(price)) {
      return `gives model "${model}" no price object ({"in": ..., "out": ...})`;
    }
    for (const [key, amount] of Object.entries(price)) {
      if (!PRICE_KEYS.has(key)) {
        return `gives model "${model}" an unknown price "${key}" (in, out, batch_in, batch_out)`;
      }
      if (typeof amount !== "number" || !Number.isFinite(amount) || amount < 0 || amount > 1_000_000) {
        return `gives model "${model}" a bad "${key}" (a number of USD per million tokens, 0 to 1000000)`;
      }
    }
    const p = price as Partial<ModelPrice>;
    if (p.in === undefined || p.out === undefined) return `gives model "${model}" no "in" or no "out" price`;
    table[model] = { ...p } as ModelPrice;
  }
  return table;
}

/** The price table from the configuration. */
export function createPrices(
  config: {
    LLM_PRICES?: Record<string, ModelPrice>;
    LLM_PRICE_IN_PER_MTOK?: number;
    LLM_PRICE_OUT_PER_MTOK?: number;
    LLM_PROVIDER?: string;
  },
): Prices {
  // The built-in extractive summariser calls no model: it costs nothing.
  if (config.LLM_PROVIDER === "extractive") {
    const free = { in: 0, out: 0 };
    return { of: () => free, models: [], pricedByDefault: true };
  }
  if (config.LLM_PRICES) {
    const table = config.LLM_PRICES;
    return {
      of: (model) => Object.hasOwn(table, model) ? table[model] : undefined,
      models: Object.keys(table),
      pricedByDefault: false,
    };
  }
  const { LLM_PRICE_IN_PER_MTOK: inPrice, LLM_PRICE_OUT_PER_MTOK: outPrice } = config;
  if (inPrice === undefined || outPrice === undefined) {
    return { of: () => undefined, models: [], pricedByDefault: false };
  }
  const price = { in: inPrice, out: outPrice };
  return { of: () => price, models: [], pricedByDefault: true };
}

/** Pico-dollars per token of a price in USD per million tokens: exact for up to six decimals. */
function picoPerToken(usdPerMTok: number): number {
  return Math.round(usdPerMTok * 1e6);
}

/**
 * A call's cost in nano-dollars, rounded up: `promptTokens` at the input price and `completionTokens` at the
 * output price (the batch prices when `batch` and the model has them).
 */
export function costNanos(price: ModelPrice, promptTokens: number, completionTokens: number, batch = false): number {
  const inPrice = batch ? price.batch_in ?? price.in : price.in;
  const outPrice = batch ? price.batch_out ?? price.out : price.out;
  const pico = promptTokens * picoPerToken(inPrice) + completionTokens * picoPerToken(outPrice);
  return Math.ceil(pico / 1000);
}

/** Nano-dollars as USD. */
export function nanosToUsd(nanos: number): number {
  return nanos / NANOS_PER_USD;
}

/** USD as whole nano-dollars (a budget's limit: rounded down, so the limit is never above what was set). */
export function usdToNanos(usd: number): number {
  return Math.floor(usd * NANOS_PER_USD + 1e-6);
}
