/**
 * Oncely's entry point and the only module that reads the environment. It
 * parses the configuration once, installs signal handlers, and either
 * launches a command with the permission set derived from the command table
 * (`main.ts launch <command>`, what every `deno task` runs) or runs it
 * (`main.ts <command>`). The launcher loads only the configuration and the
 * table; the service's code and dependencies are loaded by the process it
 * starts.
 */
import { type Command, COMMAND_TABLE, COMMANDS, isCommand } from "./src/commands.ts";
import {
  type Config,
  CONFIG_VARIABLES,
  ConfigError,
  deploymentKeyVariables,
  isSentinelUrl,
  parseConfig,
  parseSentinelUrl,
} from "./src/config.ts";
import { createLogger, type Logger } from "./src/log/logger.ts";
import { PARALLEL_KILL_AFTER_MS, parallelArgs, REUSE_PORT_ARG, superviseParallel } from "./src/launcher/parallel.ts";
import {
  DEFINITION_WORKER,
  deniesRedis,
  lookupAddresses,
  permissionFlags,
  redisHostNames,
  redisProbeFlags,
  resolveProbeFlags,
  VALIDATION_WORKER,
  withRedisAddresses,
  withRedisHosts,
} from "./src/permissions.ts";

const USAGE = `Usage: deno task <${COMMANDS.join("|")}|compile> [args]`;
const GRACE_MS = 8_000;
/** How long the launcher waits for one of its probes (cluster nodes, addresses) before going on without it. */
const PROBE_TIMEOUT_MS = 10_000;
const SELF = decodeURIComponent(new URL(import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("./migrations/", import.meta.url).pathname);

/**
 * Reads exactly the variables the service knows, so the env permission can list them: its own, and the key
 * variables LLM_DEPLOYMENTS names (the launch task may read every `LLM_KEY_*`; a process only its own).
 */
function readEnv(): Record<string, string | undefined> {
  const env = Object.fromEntries(CONFIG_VARIABLES.map((name) => [name, Deno.env.get(name)]));
  for (const name of deploymentKeyVariables(env.LLM_DEPLOYMENTS)) env[name] = Deno.env.get(name);
  return env;
}

/** Calls `onOrphaned` once the process that started this one is gone (its parent pid changed). */
function watchParent(onOrphaned: () => void): void {
  const parent = Deno.ppid;
  const watch = setInterval(() => {
    if (Deno.ppid === parent) return;
    clearInterval(watch);
    onOrphaned();
  }, 1_000);
  Deno.unrefTimer(watch);
}

/** An AbortSignal that fires on SIGTERM or SIGINT; a second signal, or the grace period, forces exit 0. */
function shutdownSignal(log: Logger): AbortSignal {
  const controller = new AbortController();
  const onSignal = (signal: Deno.Signal) => () => {
    if (controller.signal.aborted) Deno.exit(0);
    log.info("shutdown_requested", { signal });
    controller.abort(new Error(`received ${signal}`));
    // The contract promises exit within 10 s; in-flight work left now stays pending and is reclaimed.
    setTimeout(() => {
      log.warn("shutdown_forced", { after_ms: GRACE_MS });
      Deno.exit(0);
    }, GRACE_MS).unref?.();
  };
  for (const signal of ["SIGTERM", "SIGINT"] as const) Deno.addSignalListener(signal, onSignal(signal));
  // Launched by `deno task`: if the launcher is killed outright, stop gracefully rather than run orphaned.
  watchParent(() => {
    if (!controller.signal.aborted) onSignal("SIGTERM")();
  });
  return controller.signal;
}

/**
 * Runs this very Deno binary (`Deno.execPath()`, never a `deno` found on
 * PATH) with `args`, forwarding SIGTERM/SIGINT, and stopping it if this
 * launcher is orphaned. The launch task allows running exactly that path.
 */
async function spawnDeno(args: string[]): Promise<number> {
  const child = new Deno.Command(Deno.execPath(), { args, stdin: "inherit", stdout: "inherit", stderr: "inherit" })
    .spawn();
  const forward = (signal: Deno.Signal) => () => {
    try {
      child.kill(signal);
    } catch { /* already gone */ }
  };
  const handlers = (["SIGTERM", "SIGINT"] as const).map((signal) => {
    const handler = forward(signal);
    Deno.addSignalListener(signal, handler);
    return [signal, handler] as const;
  });
  // `deno task` itself may be killed outright: then the launcher must not leave the service running.
  watchParent(forward("SIGTERM"));
  const status = await child.status;
  for (const [signal, handler] of handlers) Deno.removeSignalListener(signal, handler);
  return status.code;
}

/**
 * `main.ts launch <command>`: derives the command's permission set from the
 * configured URLs (so HOST/PORT and every URL may point anywhere, and the
 * process may still reach nothing else), runs `deno run <flags> main.ts
 * <command>`, and exits with its code.
 */
async function launch(command: Command, args: string[], config: Config): Promise<number> {
  let parallel;
  try {
    parallel = parallelArgs(args, navigator.hardwareConcurrency);
  } catch (error) {
    if (!(error instanceof TypeError)) throw error;
    console.error(`Cannot start: ${error.message}`);
    return 2;
  }
  if (parallel.processes !== undefined) {
    if (command !== "api") {
      console.error(
        `Cannot start: --parallel applies to the api only (got "${command}"); start more ${command} processes`,
      );
      return 2;
    }
    if (Deno.build.os !== "linux") {
      console.error(`Cannot start: --parallel shares HOST:PORT with SO_REUSEPORT, which balances only on Linux`);
      return 2;
    }
    return await launchParallel(parallel.processes, parallel.rest, config);
  }
  return await spawnDeno(["run", ...await launchFlags(command, config), SELF, command, ...args]);
}

/**
 * `deno task api --parallel[=N]`: N API processes, each with the api's permission set, sharing HOST:PORT
 * (`src/launcher/parallel.ts` says how they are supervised). Deno 2.9 allows `reusePort` only with
 * `--unstable-net`, a feature flag that grants no permission.
 */
async function launchParallel(processes: number, args: string[], config: Config): Promise<number> {
  const flags = await launchFlags("api", config);
  const log = createLogger({ level: config.LOG_LEVEL }).child({ process: "launcher" });
  return await superviseParallel(
    () =>
      new Deno.Command(Deno.execPath(), {
        args: ["run", "--unstable-net", ...flags, SELF, "api", REUSE_PORT_ARG, ...args],
        stdin: "null",
        stdout: "inherit",
        stderr: "inherit",
      }).spawn(),
    processes,
    {
      watchParent,
      events: {
        started: (pids) => log.info("api_parallel_started", { processes: pids.length, pids }),
        lost: (pid, status) =>
          log.error("api_process_exited", { pid, code: status.code, signal: status.signal, action: "stopping all" }),
        killed: (pid) => log.error("api_process_killed", { pid, after_ms: PARALLEL_KILL_AFTER_MS }),
      },
    },
  );
}

/**
 * The permission flags `launch` gives `command`: those of its configuration,
 * plus what the launcher's probes find. A process that uses Redis, or that
 * must be kept from it (the relay), gets the cluster's nodes, or Sentinel's
 * nodes and sentinels; the relay also
 * gets the addresses REDIS_URL's host names resolve to, since Deno denies a
 * name only as written.
 */
export async function launchFlags(command: Command, config: Config): Promise<string[]> {
  const net = COMMAND_TABLE[command].net;
  let derived = net.redis || deniesRedis(net) ? await withRedisNodes(config, { required: deniesRedis(net) }) : config;
  if (deniesRedis(net)) derived = await withResolvedRedis(derived);
  return permissionFlags(command, derived, MIGRATIONS);
}

/**
 * Runs `main.ts <args>` with `flags` and `env` over this process's own; its
 * stdout, or undefined if it failed or outlived PROBE_TIMEOUT_MS.
 */
async function probe(flags: string[], args: string[], env: Record<string, string> = {}): Promise<string | undefined> {
  try {
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["run", ...flags, SELF, ...args],
      env,
      stdin: "null",
      stdout: "piped",
      stderr: "null",
      signal: AbortSignal.timeout(PROBE_TIMEOUT_MS),
    }).output();
    return out.success ? new TextDecoder().decode(out.stdout) : undefined;
  } catch {
    return undefined;
  }
}

/**
 * REDIS_URL may name one node of a Redis Cluster, but the client talks to
 * every node; or it names sentinels, and the client talks to whichever node
 * they name the master, and to the sentinels they know. A child that may
 * reach only the configured seeds or sentinels asks (`main.ts redis-nodes`):
 * for a cluster its nodes, for Sentinel the master, every replica (so a
 * promoted one is already allowed) and every sentinel. They join the
 * permission set. A standalone server, or one that does not answer, adds
 * nothing.
 */
async function withRedisNodes(config: Config, { required = false } = {}): Promise<Config> {
  const out = await probe(redisProbeFlags(config), ["redis-nodes"], { REDIS_URL: config.REDIS_URL });
  const nodes = (out ?? "").split("\n").map((line) => line.trim()).filter(Boolean);
  if (required && nodes.length === 0 && isSentinelUrl(config.REDIS_URL)) {
    // The relay's set denies Redis by address: behind Sentinel only the sentinels can say where the nodes are.
    // Without their answer it would deny the sentinels alone, and a webhook could reach the Redis nodes.
    throw new ConfigError(
      "REDIS_URL",
      "Cannot start: no sentinel in REDIS_URL named the Redis master and replicas within " +
        `${PROBE_TIMEOUT_MS / 1000} s, and the relay must deny them by address; start it once a sentinel answers`,
    );
  }
  return withRedisHosts(config, nodes);
}

/**
 * The relay's set denies Redis, and a webhook URL may spell Redis's address
 * where REDIS_URL has a name (compose's `redis`). A child that may look up
 * only those names (`main.ts resolve-hosts`) resolves them, and every
 * address joins the denied hosts. A name that does not resolve stays denied
 * by name only, which the launcher logs; the relay's own address check still
 * refuses private addresses.
 */
async function withResolvedRedis(config: Config): Promise<Config> {
  const names = redisHostNames(config);
  if (names.length === 0) return config;
  const out = await probe(resolveProbeFlags(names), ["resolve-hosts", ...names]);
  const addresses: Record<string, string[]> = out === undefined ? {} : JSON.parse(out);
  const unresolved = names.filter((name) => !addresses[name]?.length);
  if (unresolved.length > 0) {
    createLogger({ level: config.LOG_LEVEL }).child({ process: "launcher" })
      .warn("redis_denied_by_name_only", { hosts: unresolved, reason: "did not resolve" });
  }
  return withRedisAddresses(config, addresses);
}

/**
 * `main.ts launch compile`: one binary per command the table marks, each with
 * the permission set for this configuration's hosts (the providers' default
 * hosts when no key is configured) baked in, and the schema validation
 * Worker's module for those that start one.
 */
async function compile(env: Record<string, string | undefined>): Promise<number> {
  const config = parseConfig({
    ...env,
    ...Object.fromEntries(deploymentKeyVariables(env.LLM_DEPLOYMENTS).map((name) => [name, env[name] || "compile"])),
    OPENAI_API_KEY: env.OPENAI_API_KEY || "compile",
    RESEND_API_KEY: env.RESEND_API_KEY || "compile",
  });
  for (const command of COMMANDS.filter((c) => COMMAND_TABLE[c].binary)) {
    const flags = permissionFlags(command, config, MIGRATIONS, { binary: true });
    // A Worker's module is loaded at run time, so the binary holds it only if told to.
    const include = COMMAND_TABLE[command].validation
      ? ["--include", VALIDATION_WORKER, "--include", DEFINITION_WORKER]
      : [];
    const code = await spawnDeno([
      "compile",
      "--output",
      `dist/oncely-${command}`,
      ...include,
      ...flags,
      SELF,
      command,
    ]);
    if (code !== 0) return code;
  }
  return 0;
}

async function main(argv: string[]): Promise<number> {
  if (argv[0] === "redis-nodes") {
    // REDIS_URL alone: the probe may read no deployment's key, and needs none.
    const url = parseConfig({ REDIS_URL: Deno.env.get("REDIS_URL") }).REDIS_URL;
    let nodes: string[];
    if (isSentinelUrl(url)) {
      const { sentinelNodes } = await import("./src/redis/sentinel_nodes.ts");
      nodes = await sentinelNodes(parseSentinelUrl(url));
    } else {
      const { clusterNodes } = await import("./src/redis/cluster_nodes.ts");
      nodes = await clusterNodes(url.split(",")[0]!.trim());
    }
    for (const node of nodes) console.log(node);
    return 0;
  }
  if (argv[0] === "resolve-hosts") {
    console.log(JSON.stringify(await lookupAddresses(argv.slice(1))));
    return 0;
  }
  const launching = argv[0] === "launch";
  const [command, ...args] = launching ? argv.slice(1) : argv;
  const compiling = launching && command === "compile";
  if (!isCommand(command) && !compiling) {
    console.error(USAGE);
    return 2;
  }
  const env = readEnv();
  let config: Config;
  try {
    // A binary is built without the keys: compile() stands in for them.
    if (compiling) return await compile(env);
    config = parseConfig(env);
  } catch (error) {
    if (error instanceof ConfigError) {
      console.error(error.message);
      return 2;
    }
    throw error;
  }
  if (launching) {
    try {
      return await launch(command as Command, args, config);
    } catch (error) {
      if (!(error instanceof ConfigError)) throw error;
      console.error(error.message);
      return 2;
    }
  }
  const log = createLogger({ level: config.LOG_LEVEL }).child({ process: command });
  const { runCommand } = await import("./src/host.ts");
  return await runCommand(command as Command, { config, args, shutdown: () => shutdownSignal(log) });
}

if (import.meta.main) Deno.exit(await main(Deno.args));
