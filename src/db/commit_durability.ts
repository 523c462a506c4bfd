/**
 * Whether a COMMIT survives a failover. The worker acknowledges a job only
 * after its commit returns; if the primary then dies before its standby has
 * that commit's WAL, the promoted standby has no trace of the job while
 * Redis has forgotten it: acknowledged, never done. With a synchronous
 * standby (`synchronous_standby_names` set on the primary, and
 * `synchronous_commit` `on` or `remote_apply`) a COMMIT returns only once a
 * standby has flushed its WAL, so every acknowledged job is on the standby
 * that takes over.
 */
import type { Sql } from "postgres";
import type { Logger } from "../log/logger.ts";

/** The settings of a session on the primary, and what they promise. */
export interface CommitDurability {
  synchronousCommit: string;
  synchronousStandbyNames: string;
  /** A COMMIT returns only after a synchronous standby has flushed it (and, with remote_apply, applied it). */
  survivesFailover: boolean;
}

/** The `synchronous_commit` values that wait for a standby's flush. */
const WAITS_FOR_STANDBY_FLUSH = new Set(["on", "remote_apply"]);

/**
 * Reads this session's `synchronous_commit` and the primary's
 * `synchronous_standby_names` (a role, database or URL may override the
 * former), and logs one warning naming the risk when a failover could lose
 * acknowledged commits. Run at start-up when DATABASE_URL lists several hosts.
 */
export async function checkCommitDurability({ sql, log }: { sql: Sql; log: Logger }): Promise<CommitDurability> {
  const [row] = await sql<{ commit: string; names: string }[]>`
    SELECT current_setting('synchronous_commit') AS commit, current_setting('synchronous_standby_names') AS names`;
  const synchronousCommit = row!.commit;
  const synchronousStandbyNames = row!.names;
  const survivesFailover = synchronousStandbyNames.trim() !== "" && WAITS_FOR_STANDBY_FLUSH.has(synchronousCommit);
  if (!survivesFailover) {
    log.warn("postgres_standby_asynchronous", {
      synchronous_commit: synchronousCommit,
      synchronous_standby_names: synchronousStandbyNames,
      risk: "a COMMIT returns before a standby has it: after a failover, jobs the worker committed and " +
        "acknowledged may be missing on the new primary and never finish; set synchronous_standby_names " +
        "on the primary and synchronous_commit=on (README: Postgres with a standby)",
    });
  }
  return { synchronousCommit, synchronousStandbyNames, survivesFailover };
}
