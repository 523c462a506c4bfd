import { sha256Hex } from "../crypto/digest.ts";
import type { Sql } from "postgres";
import type { Logger } from "../log/logger.ts";

/** One migration file. */
export interface Migration {
  name: string;
  sql: string;
}

/** Default location of the numbered SQL files. */
export const MIGRATIONS_DIR = new URL("../../migrations/", import.meta.url);

const MIGRATION_FILE = /^\d{3,}_[a-z0-9_]+\.sql$/;
// Any constant works; every migrating process must use the same one.
const LOCK_ID = 7_220_531_101;

/** Reads `NNN_name.sql` files from a directory, sorted by name. */
export async function readMigrations(dir: URL = MIGRATIONS_DIR): Promise<Migration[]> {
  const out: Migration[] = [];
  for await (const entry of Deno.readDir(dir)) {
    if (!entry.isFile || !entry.name.endsWith(".sql")) continue;
    if (!MIGRATION_FILE.test(entry.name)) {
      throw new Error(`Migration file name must look like 001_name.sql (got "${entry.name}")`);
    }
    out.push({ name: entry.name, sql: await Deno.readTextFile(new URL(entry.name, dir)) });
  }
  return out.sort((a, b) => a.name.localeCompare(b.name));
}

/**
 * Applies migrations in order, each in its own transaction, recording them in
 * `oncely_migrations`. Safe to run twice and from several processes at once:
 * a transaction-scoped advisory lock serialises them, and each re-checks what
 * is applied after taking it.
 * @returns the names applied by this call.
 * @throws if an applied migration's file has since changed.
 */
export async function migrate(
  { sql, log }: { sql: Sql; log: Logger },
  migrations: Migration[],
): Promise<string[]> {
  const applied: string[] = [];
  for (const migration of migrations) {
    const checksum = sha256Hex(migration.sql);
    const didApply = await sql.begin(async (tx) => {
      await tx`SELECT pg_advisory_xact_lock(${LOCK_ID})`;
      await tx`CREATE TABLE IF NOT EXISTS oncely_migrations (
        name text PRIMARY KEY, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`;
      const [row] = await tx<{ checksum: string }[]>`
        SELECT checksum FROM oncely_migrations WHERE name = ${migration.name}`;
      if (row) {
        if (row.checksum !== checksum) {
          throw new Error(`Migration ${migration.name} was changed after it was applied; add a new migration instead`);
        }
        return false;
      }
      await tx.unsafe(migration.sql);
      await tx`INSERT INTO oncely_migrations (name, checksum) VALUES (${migration.name}, ${checksum})`;
      return true;
    });
    if (didApply) {
      applied.push(migration.name);
      log.info("migration_applied", { name: migration.name });
    }
  }
  return applied;
}
