/**
 * The tenant change log (migration 022): which tenants' API keys, allow lists
 * or webhook secret changed since a snapshot. Triggers write a row per change,
 * stamped with its transaction's id, so a reader that keeps the snapshot of
 * its last look finds every change that look could not see, including one
 * whose transaction began before the look and committed after it: a change is
 * new to a snapshot exactly when its transaction id is not visible in it.
 */
import type { Sql } from "postgres";

/** A Postgres snapshot (`pg_snapshot`): the transactions whose effects it sees. */
export interface Snapshot {
  /** Every transaction below it had ended when the snapshot was taken. */
  readonly xmin: bigint;
  /** Every transaction from it on had not started. */
  readonly xmax: bigint;
  /** The transactions between the two still in progress. */
  readonly xip: ReadonlySet<bigint>;
  /** As Postgres spells it, to hand back. */
  readonly text: string;
}

/** Reads `pg_snapshot`'s text form, `xmin:xmax:xip,...`. @throws {TypeError} on anything else. */
export function parseSnapshot(text: string): Snapshot {
  const match = /^(\d+):(\d+):([\d,]*)$/.exec(text);
  if (!match) throw new TypeError(`Not a pg_snapshot: ${JSON.stringify(text)}`);
  const xip = match[3] ? match[3].split(",").map(BigInt) : [];
  return { xmin: BigInt(match[1]!), xmax: BigInt(match[2]!), xip: new Set(xip), text };
}

/**
 * Whether a committed transaction's effects are visible in the snapshot (Postgres's `pg_visible_in_snapshot`):
 * it ended before the snapshot, not in progress when it was taken.
 */
export function visibleIn(xid: bigint, snapshot: Snapshot): boolean {
  return xid < snapshot.xmin || (xid < snapshot.xmax && !snapshot.xip.has(xid));
}

/** What a look at the log found. */
export interface TenantChanges {
  /** The snapshot the look was taken in: the next look asks what it could not see. */
  snapshot: Snapshot;
  /**
   * The tenants whose rows changed in a transaction `since` could not see (none when `since` is unset); null when
   * any tenant may have changed: a table was truncated, or there were more than {@linkcode CHANGES_READ_LIMIT}.
   */
  tenants: Set<string> | null;
}

/**
 * Looks at the log: with `since`, the tenants changed by a transaction not visible in it; without, only the
 * snapshot to start from.
 */
export type TenantChangeFeed = (since?: Snapshot) => Promise<TenantChanges>;

/** The most rows one look reads: past it, the reader treats every tenant as changed. */
export const CHANGES_READ_LIMIT = 10_000;

/**
 * The feed over a database's log. One statement gives both the snapshot and the rows it sees, so no change
 * falls between the two.
 */
export function tenantChangeFeed(sql: Sql): TenantChangeFeed {
  return async (since) => {
    if (!since) {
      const [row] = await sql<{ snapshot: string }[]>`SELECT pg_current_snapshot()::text AS snapshot`;
      return { snapshot: parseSnapshot(row!.snapshot), tenants: new Set() };
    }
    // Every transaction the earlier snapshot could not see is at or above its xmin (the index's range); of those,
    // the ones it saw are left out here, so a long transaction elsewhere does not make every look read more.
    const rows = await sql<{ snapshot: string; tenant: string | null; xid: string | null }[]>`
      SELECT s.snapshot, c.tenant, c.xid::text AS xid
      FROM (SELECT pg_current_snapshot()::text AS snapshot) s
      LEFT JOIN LATERAL (
        SELECT tenant, xid FROM tenant_changes
        WHERE xid >= ${String(since.xmin)}::xid8 AND NOT pg_visible_in_snapshot(xid, ${since.text}::pg_snapshot)
        LIMIT ${CHANGES_READ_LIMIT + 1}
      ) c ON true`;
    const snapshot = parseSnapshot(rows[0]!.snapshot);
    if (rows.length > CHANGES_READ_LIMIT) return { snapshot, tenants: null };
    const tenants = new Set<string>();
    for (const { tenant, xid } of rows) {
      if (tenant === null || visibleIn(BigInt(xid!), since)) continue;
      if (tenant === EVERY_TENANT) return { snapshot, tenants: null };
      tenants.add(tenant);
    }
    return { snapshot, tenants };
  };
}

/** The log's row for a change to every tenant (a TRUNCATE): no tenant is named `*`. */
const EVERY_TENANT = "*";

/**
 * How long the log keeps a row after its transaction was seen to end: a cache that has not looked for half of it
 * reads everything again instead.
 */
export const CHANGES_KEPT_MS = 3_600_000;

/**
 * Deletes up to `limit` rows of the log (a batch of retention's, `retention.ts`): those of transactions that had
 * ended `olderThanMs` ago. Each call records the oldest transaction running now (its snapshot's xmin) with the
 * time, and deletes the rows below the xmin recorded at least `olderThanMs` before: every look since then sees
 * them. The time of a row's own write would not do: a transaction that began two hours ago may commit now.
 * @returns rows deleted.
 */
export async function deleteOldChanges(
  sql: Sql,
  { olderThanMs = CHANGES_KEPT_MS, limit }: { olderThanMs?: number; limit: number },
): Promise<number> {
  await sql`
    INSERT INTO tenant_change_horizons (at, oldest_running) VALUES (now(), pg_snapshot_xmin(pg_current_snapshot()))
    ON CONFLICT DO NOTHING`;
  // As text: postgres.js would round a timestamptz to the millisecond.
  const [horizon] = await sql<{ at: string; xmin: string }[]>`
    SELECT at::text AS at, oldest_running::text AS xmin FROM tenant_change_horizons
    WHERE at < now() - ${olderThanMs} * interval '1 millisecond' ORDER BY at DESC LIMIT 1`;
  if (!horizon) return 0;
  // Older horizons are below this one: only the newest old enough is needed.
  await sql`DELETE FROM tenant_change_horizons WHERE at < ${horizon.at}::timestamptz`;
  const rows = await sql`
    DELETE FROM tenant_changes WHERE ctid IN (
      SELECT ctid FROM tenant_changes WHERE xid < ${horizon.xmin}::xid8 LIMIT ${limit})`;
  return rows.count;
}
