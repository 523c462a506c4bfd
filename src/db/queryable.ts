import type { ISql, PendingQuery, Row } from "postgres";

/**
 * What a store's function runs its statements on: the pool, or a
 * transaction that spans several stores (`sql.begin(async (tx) => ...)`).
 */
export type Queryable = ISql;

/** A piece of SQL built by one store to be spliced into another store's statement. */
export type Fragment = PendingQuery<Row[]>;

/** How old a row must be to go, and how many go at most in one statement. */
export interface ExpiryBatch {
  olderThanMs: number;
  limit: number;
}

/**
 * Deletes up to `limit` rows of `table` that `where` matches (the row is
 * `t`), picked by `key`: one batch of a retention pass. @returns rows deleted.
 */
export async function deleteBatch(
  sql: Queryable,
  { table, key, where, limit }: { table: string; key: string; where: Fragment; limit: number },
): Promise<number> {
  const deleted = await sql`
    DELETE FROM ${sql(table)} WHERE ${sql(key)} IN (
      SELECT t.${sql(key)} FROM ${sql(table)} t WHERE ${where} LIMIT ${limit}
    )`;
  return deleted.count;
}

/** The condition "`column` of row `t` is more than `ms` ago". */
export function olderThan(sql: Queryable, column: string, ms: number): Fragment {
  return sql`t.${sql(column)} < now() - ${ms} * interval '1 millisecond'`;
}
