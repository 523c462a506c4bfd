/**
 * Tenant weights: each tenant's share of the model provider while several
 * have work (`tenants.weight`, 1 unless `deno task tenant set NAME --weight N`
 * changed it). Workers read them from a cache refreshed every few seconds,
 * never with a query per job.
 */
import type { Sql } from "postgres";
import type { Logger } from "../log/logger.ts";

/** The weight bounds and default, as the table's check constraint has them. */
export const TENANT_WEIGHT = { min: 1, max: 1_000, default: 1 } as const;

/** How long workers use a read of the weights before reading them again: a change shows within this. */
export const TENANT_WEIGHTS_TTL_MS = 10_000;

/**
 * Reads a weight as typed on the command line: a whole number from 1 to 1000.
 * @throws {TypeError} for anything else, naming the value.
 */
export function parseTenantWeight(text: string | undefined): number {
  const weight = text !== undefined && /^\d{1,4}$/.test(text) ? Number(text) : NaN;
  if (!(weight >= TENANT_WEIGHT.min && weight <= TENANT_WEIGHT.max)) {
    throw new TypeError(
      `Weight must be a whole number from ${TENANT_WEIGHT.min} to ${TENANT_WEIGHT.max} (got ${JSON.stringify(text)})`,
    );
  }
  return weight;
}

/**
 * Sets a tenant's weight. @returns false when there is no such tenant.
 * @throws {TypeError} for a weight out of bounds.
 */
export async function setTenantWeight(sql: Sql, tenant: string, weight: number): Promise<boolean> {
  if (!Number.isInteger(weight) || weight < TENANT_WEIGHT.min || weight > TENANT_WEIGHT.max) {
    throw new TypeError(`Weight must be a whole number from 1 to 1000 (got ${weight})`);
  }
  const rows = await sql`UPDATE tenants SET weight = ${weight} WHERE name = ${tenant} RETURNING name`;
  return rows.length > 0;
}

/** Every tenant's weight, from a cache; a tenant not listed weighs {@linkcode TENANT_WEIGHT.default}. */
export interface TenantWeights {
  /**
   * The weights of tenants whose weight is not the default. The first call waits for the first read;
   * later calls answer at once and refresh the cache in the background once it is `ttlMs` old.
   * Never throws: a failed read keeps the last weights (at first, the defaults) and is tried again a TTL later.
   */
  current(): Promise<ReadonlyMap<string, number>>;
}

/** A cache of the tenants' weights, read with one query every `ttlMs` at most. */
export function createTenantWeights(
  { sql, log }: { sql: Sql; log: Logger },
  { ttlMs = TENANT_WEIGHTS_TTL_MS, now = () => performance.now() }: { ttlMs?: number; now?: () => number } = {},
): TenantWeights {
  let weights: ReadonlyMap<string, number> = new Map();
  let readAt = -Infinity;
  let reading: Promise<void> | undefined;
  const read = async () => {
    try {
      // Only the tenants that differ: with thousands of tenants at the default, the answer stays small.
      const rows = await sql<{ name: string; weight: number }[]>`
        SELECT name, weight FROM tenants WHERE weight <> ${TENANT_WEIGHT.default}`;
      weights = new Map(rows.map((r) => [r.name, r.weight]));
    } catch (error) {
      log.warn("tenant_weights_unavailable", { error });
    } finally {
      readAt = now();
      reading = undefined;
    }
  };
  return {
    async current() {
      if (now() - readAt >= ttlMs) {
        const first = readAt === -Infinity;
        reading ??= read();
        if (first) await reading;
      }
      return weights;
    },
  };
}
