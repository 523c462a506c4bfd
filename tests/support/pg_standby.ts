/**
 * A local Postgres primary with a streaming standby, for failover tests and
 * the chaos run: `initdb` a primary on a free loopback port in a temporary
 * directory, `pg_basebackup -R` a standby from it on another, and (unless
 * told otherwise) make the standby synchronous, so a COMMIT returns only
 * once the standby has flushed its WAL. The migrations are applied on the
 * primary. Runs the server binaries as the `postgres` OS user when the tests
 * run as root (initdb refuses root). A few seconds.
 */
import postgres from "postgres";
import { sleep } from "../../src/async/timeout.ts";
import { migrate, readMigrations } from "../../src/db/migrate.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { freePort } from "./free_port.ts";

/** A running primary and standby. */
export interface PgStandby {
  /** `postgres://postgres@127.0.0.1:<primary>,127.0.0.1:<standby>/postgres?target_session_attrs=read-write`. */
  url: string;
  primaryPort: number;
  standbyPort: number;
  /** `pg_ctl stop -m immediate` on the primary: a crash, as far as its clients and the standby can tell. */
  stopPrimaryImmediate(): Promise<void>;
  /** `pg_ctl promote` on the standby; resolves once it accepts writes. */
  promoteStandby(): Promise<void>;
  /** Stops both servers (whatever state they are in) and deletes the directory. */
  stop(): Promise<void>;
}

const decoder = new TextDecoder();

/** The command line that runs `binary` from Postgres's bindir as the `postgres` user when we are root. */
async function serverCommand(): Promise<(binary: string, args: string[]) => Promise<string>> {
  const config = await new Deno.Command("pg_config", { args: ["--bindir"], stdout: "piped" }).output();
  if (!config.success) throw new Error("pg_standby: pg_config --bindir failed (is PostgreSQL installed?)");
  const bindir = decoder.decode(config.stdout).trim();
  const root = Deno.uid() === 0;
  return async (binary, args) => {
    const path = `${bindir}/${binary}`;
    const out = await new Deno.Command(root ? "runuser" : path, {
      args: root ? ["-u", "postgres", "--", path, ...args] : args,
      stdin: "null",
      stdout: "piped",
      stderr: "piped",
    }).output();
    const text = decoder.decode(out.stdout) + decoder.decode(out.stderr);
    if (!out.success) throw new Error(`pg_standby: ${binary} ${args.join(" ")} failed: ${text.trim()}`);
    return text;
  };
}

/** The `postgres` user's uid and gid, to hand it the temporary directory. */
async function postgresUser(): Promise<{ uid: number; gid: number }> {
  const id = async (flag: string) => {
    const out = await new Deno.Command("id", { args: [flag, "postgres"], stdout: "piped" }).output();
    if (!out.success) throw new Error("pg_standby: running as root needs a `postgres` OS user");
    return Number(decoder.decode(out.stdout).trim());
  };
  return { uid: await id("-u"), gid: await id("-g") };
}

async function until(what: string, check: () => Promise<boolean>, timeoutMs = 20_000): Promise<void> {
  const end = performance.now() + timeoutMs;
  while (!(await check().catch(() => false))) {
    if (performance.now() > end) throw new Error(`pg_standby: timed out waiting for ${what}`);
    await sleep(50);
  }
}

/** Runs one query on a fresh single connection to `port` (no retries, no multi-host). */
async function query<T>(port: number, text: string): Promise<T[]> {
  const sql = postgres({
    host: "127.0.0.1",
    port,
    user: "postgres",
    database: "postgres",
    max: 1,
    connect_timeout: 2,
    onnotice: () => {},
  });
  try {
    return [...await sql.unsafe(text)] as T[];
  } finally {
    await sql.end({ timeout: 0 });
  }
}

/**
 * Starts a primary and a standby. `synchronous: false` leaves the standby
 * asynchronous (`synchronous_standby_names` empty), the risky set-up the
 * service warns about. `maxConnections` is both servers' max_connections
 * (the standby's may not be lower than the primary's): the chaos run's five
 * processes and their restarts need more than the default 60.
 * @throws {Error} naming the step that failed; whatever was started is stopped and removed first.
 */
export async function startPgStandby(
  { synchronous = true, migrations = true, maxConnections = 60 } = {},
): Promise<PgStandby> {
  const run = await serverCommand();
  const dir = await Deno.makeTempDir({ prefix: "oncely-pg-standby-" });
  if (Deno.uid() === 0) {
    const { uid, gid } = await postgresUser();
    await Deno.chown(dir, uid, gid);
  }
  const primaryPort = freePort();
  const standbyPort = freePort();
  const primary = `${dir}/primary`;
  const standby = `${dir}/standby`;
  const settings = (port: number) =>
    [
      `port = ${port}`,
      "listen_addresses = '127.0.0.1'",
      `unix_socket_directories = '${dir}'`,
      "wal_level = replica",
      "max_wal_senders = 4",
      "hot_standby = on",
      `max_connections = ${maxConnections}`,
      "shared_buffers = 16MB",
      // The standby reports its flush position often, so a synchronous COMMIT waits for little more than its fsync.
      "wal_receiver_status_interval = 1s",
    ].join("\n") + "\n";
  const started: string[] = [];
  const pgCtl = (data: string, action: string, extra: string[] = []) =>
    run("pg_ctl", ["-D", data, "-l", `${data}.log`, "-w", "-t", "20", ...extra, action]);
  const stopServer = async (data: string) => {
    if (!started.includes(data)) return;
    await pgCtl(data, "stop", ["-m", "immediate"]).catch(() => {});
  };
  const stop = async () => {
    await stopServer(standby);
    await stopServer(primary);
    started.length = 0;
    await Deno.remove(dir, { recursive: true }).catch(() => {});
  };
  try {
    await run("initdb", ["-D", primary, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--no-locale"]);
    await Deno.writeTextFile(`${primary}/postgresql.conf`, settings(primaryPort), { append: true });
    await pgCtl(primary, "start");
    started.push(primary);
    await run("pg_basebackup", [
      ...["-h", "127.0.0.1", "-p", String(primaryPort), "-U", "postgres", "-D", standby],
      ...["-R", "-X", "stream", "-c", "fast", "--no-sync"],
    ]);
    // The copy carries the primary's port; the standby gets its own (a later line wins).
    await Deno.writeTextFile(`${standby}/postgresql.conf`, settings(standbyPort), { append: true });
    await pgCtl(standby, "start");
    started.push(standby);
    const replication = () =>
      query<{ state: string; sync_state: string }>(primaryPort, "SELECT state, sync_state FROM pg_stat_replication");
    await until("the standby to stream", async () => (await replication()).some((r) => r.state === "streaming"));
    if (synchronous) {
      // Set on the primary only, after the copy: a promoted standby with no standby of its own must not wait
      // for one at every COMMIT.
      await query(primaryPort, "ALTER SYSTEM SET synchronous_standby_names = '*'");
      await query(primaryPort, "SELECT pg_reload_conf()");
      await until(
        "the standby to be synchronous",
        async () => (await replication()).some((r) => r.sync_state === "sync"),
      );
    }
    const url = `postgres://postgres@127.0.0.1:${primaryPort},127.0.0.1:${standbyPort}/postgres` +
      "?target_session_attrs=read-write";
    if (migrations) {
      const sql = postgres(`postgres://postgres@127.0.0.1:${primaryPort}/postgres`, { max: 1, onnotice: () => {} });
      try {
        await migrate({ sql, log: silentLogger }, await readMigrations());
      } finally {
        await sql.end({ timeout: 1 });
      }
    }
    return {
      url,
      primaryPort,
      standbyPort,
      async stopPrimaryImmediate() {
        await pgCtl(primary, "stop", ["-m", "immediate"]);
        started.splice(started.indexOf(primary), 1);
      },
      async promoteStandby() {
        await pgCtl(standby, "promote");
        await until("the standby to accept writes", async () => {
          const [row] = await query<{ recovery: boolean }>(standbyPort, "SELECT pg_is_in_recovery() AS recovery");
          return row?.recovery === false;
        });
      },
      stop,
    };
  } catch (error) {
    await stop();
    throw error;
  }
}
