/**
 * `deno task chaos --pg-failover [--pg-async]`: the chaos run on a Postgres
 * primary and a streaming standby (tests/support/pg_standby.ts), with the
 * usual process kills, client retries, emails and webhooks. Every process
 * gets `DATABASE_URL` = both hosts with `target_session_attrs=read-write`.
 * Mid-run the primary is stopped with `pg_ctl stop -m immediate` and the
 * standby promoted, and the API's `/readyz` must be 200 again within 10 s
 * of the promotion, in the same process (no kill lands meanwhile).
 *
 * The standby is synchronous (`synchronous_standby_names = '*'`), so every
 * commit the worker acknowledged is on it; `--pg-async` leaves it
 * asynchronous, the set-up that can lose acknowledged jobs: the run's usual
 * checks then show what, if anything, was lost.
 *
 * Kept apart from run.ts, which only calls these hooks: start the pair
 * ({@linkcode startPgFailover}), fail over ({@linkcode PgFailover.failover}),
 * add its rows and verdict, and stop it (`db.close()`).
 */
import type { Sql } from "postgres";
import { sleep } from "../../src/async/timeout.ts";
import { connectPostgres } from "../../src/clients.ts";
import { startPgStandby } from "../support/pg_standby.ts";

/** How soon after the promotion the API's `/readyz` must be 200 again. */
export const READYZ_BOUND_S = 10;
/** How often a new `/readyz` request leaves while waiting (each is bounded by the API's own 1 s). */
const READYZ_EVERY_MS = 25;

/** Which mode the command line asks for: none, or the pair with a synchronous or an asynchronous standby. */
export function pgFailoverMode(args: string[]): { synchronous: boolean } | undefined {
  if (!args.includes("--pg-failover") && !args.includes("--pg-async")) return undefined;
  if (args.includes("--pg-terminate")) {
    console.error("--pg-failover does not combine with --pg-terminate (which terminates on the local server)");
    Deno.exit(2);
  }
  return { synchronous: !args.includes("--pg-async") };
}

/** What the failover step measured. */
interface Failover {
  /** Seconds from `pg_ctl promote` to the standby accepting writes. */
  promoteS: number;
  /** The API answered `/readyz` 503 between the primary's stop and its 200 again. */
  saw503: boolean;
  /** Seconds from the promotion (the standby accepting writes) to the API's first `/readyz` 200, or null if none. */
  readyAfterPromoteS: number | null;
  /** The same, from the primary's stop. */
  readyAfterStopS: number | null;
  /** The API process at the 200 is the one that was serving before the stop, and still running. */
  sameProcess: boolean;
}

/** The pair, the database handle run.ts uses in place of a scratch database, and the failover step. */
export interface PgFailover {
  /** As a scratch database: `url` (multi-host) for every process, `sql` for the run's own queries. */
  db: { sql: Sql; url: string; name: string; close(): Promise<void> };
  synchronous: boolean;
  /** Whether the failover has been done. */
  readonly done: boolean;
  /**
   * Waits for the API's `/readyz` 200 (so it is connected to the primary), stops the primary (immediate),
   * promotes the standby, and sends a `/readyz` every 25 ms until one is 200 (at most 10 s). The caller makes
   * sure no process is killed meanwhile. @returns the event line for the run's table.
   */
  failover(api: { port: number; child: () => Deno.ChildProcess }): Promise<string>;
  /** The run's table rows for this mode. */
  rows(): [string, string][];
  /** This mode's own verdict: failed over, and `/readyz` 200 again within the bound in the same process. */
  ok(): boolean;
  /** Why {@linkcode ok} is false, for the failure message. */
  problem(): string | undefined;
}

/** `/readyz` of the API: its status, or 0 when it did not answer. */
async function readyz(port: number): Promise<number> {
  try {
    const res = await fetch(`http://127.0.0.1:${port}/readyz`, { signal: AbortSignal.timeout(2_000) });
    await res.body?.cancel();
    return res.status;
  } catch {
    return 0;
  }
}

/**
 * Starts the primary and the standby (migrated, 200 connections each for five processes, their restarts and
 * the run's own pool), and opens the run's pool on the multi-host URL with the service's own client, which
 * follows the promotion (`withDatabase`'s `new URL` cannot parse a multi-host URL).
 */
export async function startPgFailover({ synchronous }: { synchronous: boolean }): Promise<PgFailover> {
  const pair = await startPgStandby({ synchronous, migrations: true, maxConnections: 200 });
  const sql = await connectPostgres(pair.url, { max: 4 }).catch(async (error) => {
    await pair.stop();
    throw error;
  });
  let result: Failover | undefined;
  return {
    db: {
      sql,
      url: pair.url,
      name: "postgres",
      async close() {
        await sql.end({ timeout: 1 });
        await pair.stop();
      },
    },
    synchronous,
    get done() {
      return result !== undefined;
    },
    async failover(api) {
      // The API serves from the primary before the stop: a process that was just restarted is up first.
      const upBy = performance.now() + 10_000;
      while ((await readyz(api.port)) !== 200 && performance.now() < upBy) await sleep(50);
      const before = api.child();
      let exited = false;
      before.status.then(() => (exited = true));
      const stopped = performance.now();
      await pair.stopPrimaryImmediate();
      let saw503 = false;
      // Probe while no host is the primary too: the API should answer 503 then, not hang.
      let probing = true;
      const probes = (async () => {
        while (probing) {
          readyz(api.port).then((s) => s === 503 && (saw503 = true));
          await sleep(READYZ_EVERY_MS);
        }
      })();
      const promoteStarted = performance.now();
      await pair.promoteStandby();
      const promoted = performance.now();
      probing = false;
      await probes;
      // From the promotion: a new request every 25 ms, each on its own, and the first 200's answer time counts.
      let readyAt: number | null = null;
      const pending: Promise<void>[] = [];
      while (readyAt === null && performance.now() - promoted < READYZ_BOUND_S * 1000) {
        pending.push(
          readyz(api.port).then((s) => {
            if (s === 503) saw503 = true;
            if (s === 200 && readyAt === null) readyAt = performance.now();
          }),
        );
        await sleep(READYZ_EVERY_MS);
      }
      await Promise.all(pending);
      const at = readyAt as number | null;
      result = {
        promoteS: (promoted - promoteStarted) / 1000,
        saw503,
        readyAfterPromoteS: at === null ? null : (at - promoted) / 1000,
        readyAfterStopS: at === null ? null : (at - stopped) / 1000,
        sameProcess: api.child() === before && !exited,
      };
      return `postgres primary stopped (pg_ctl stop -m immediate), ${
        synchronous ? "synchronous" : "asynchronous"
      } standby promoted in ${result.promoteS.toFixed(2)} s`;
    },
    rows() {
      const r = result;
      return [
        [
          "postgres standby",
          synchronous ? "synchronous (synchronous_standby_names = '*')" : "asynchronous (--pg-async)",
        ],
        [
          `API /readyz 200 again after the promotion (same process; bound ${READYZ_BOUND_S} s) / after the stop`,
          !r
            ? "no failover"
            : r.readyAfterPromoteS === null
            ? `not within ${READYZ_BOUND_S} s`
            : `${r.readyAfterPromoteS.toFixed(2)} s / ${r.readyAfterStopS!.toFixed(2)} s${
              r.sameProcess ? "" : " (NOT the same process)"
            }${r.saw503 ? ", 503 in between" : ""}`,
        ],
      ];
    },
    ok: () => problem() === undefined,
    problem: () => problem(),
  };

  function problem(): string | undefined {
    if (!result) return "the Postgres failover did not happen (the kill period was too short?)";
    if (result.readyAfterPromoteS === null) {
      return `the API's /readyz was not 200 within ${READYZ_BOUND_S} s of the promotion`;
    }
    if (!result.sameProcess) return "the API process was restarted or exited during the failover";
    return undefined;
  }
}
