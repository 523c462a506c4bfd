import type { ISql, PendingQuery, Row } from "postgres";

/**
 * What a store's function runs its statements on: the pool, or a
 * transaction that spans several stores (`sql.begin(async (tx) => ...)`).
 */
export type Queryable = ISql;

/** A piece of SQL built by one store to be spliced into another store's statement. */
export type Fragment = PendingQuery<Row[]>;
