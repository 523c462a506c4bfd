import { z } from "zod";
import { parsePrices } from "./llm/prices.ts";
import type { ConfiguredDeployment } from "./llm/deployment_specs.ts";

const int = (min: number, max = Number.MAX_SAFE_INTEGER) =>
  z.string().trim().regex(/^\d+$/, `must be a whole number`).transform(Number)
    .pipe(z.number().int().min(min, `must be at least ${min}`).max(max, `must be at most ${max}`));

const seconds = z.string().trim().regex(/^\d+(\.\d+)?$/, "must be a number of seconds")
  .transform(Number).pipe(z.number().positive("must be greater than 0"));

const bool = z.enum(["true", "false"], "must be true or false").transform((v) => v === "true");

const url = (protocols: string[], example: string) =>
  z.string().trim().refine((value) => {
    try {
      return protocols.includes(new URL(value).protocol);
    } catch {
      return false;
    }
  }, `is not a ${protocols.map((p) => p.replace(":", "://")).join(" or ")} URL (for example ${example})`);

const schema = z.object({
  // One node (standalone, or any node of a cluster), a comma-separated list of cluster seed nodes, or sentinels.
  REDIS_URL: z.string().trim().refine(
    (value) =>
      isSentinelUrl(value) ||
      value.split(",").every((part) => url(["redis:", "rediss:"], "").safeParse(part.trim()).success),
    "is not a redis:// or rediss:// URL, nor a comma-separated list of them (for example redis://127.0.0.1:6379/0), " +
      "nor a redis+sentinel:// URL",
  ).superRefine(checkSentinelUrl).default("redis://127.0.0.1:6379"),
  // One host, or several (`postgres://u@h1:5432,h2:5432/db?target_session_attrs=read-write`): see parseConfig.
  DATABASE_URL: z.string().trim().refine(
    (value) => postgresHosts(value) !== undefined,
    "is not a postgres:// or postgresql:// URL with one host, or a comma-separated list of host:port " +
      "(an IPv6 address only alone; for example postgres://postgres@127.0.0.1:5432/postgres)",
  ).default("postgres://postgres@127.0.0.1:5432/postgres"),
  HOST: z.string().trim().min(1, "must not be empty").default("127.0.0.1"),
  PORT: int(0, 65535).default(8000),
  AUTH_MODE: z.enum(["api-key", "trusted-header"], "must be api-key or trusted-header").default("api-key"),
  LLM_PROVIDER: z.enum(["openai", "extractive"], "must be openai or extractive").optional(),
  OPENAI_API_KEY: z.string().min(1).optional(),
  OPENAI_BASE_URL: url(["http:", "https:"], "https://api.openai.com/v1").optional(),
  OPENAI_MODEL: z.string().trim().min(1, "must not be empty").default("gpt-4.1-mini"),
  // JSON [{"name", "base_url", "api_key_env", "models", "weight"?, "rpm"?, "tpm"?, "batch"?}]: see parseConfig
  // for the keys, which live in the variables the deployments name.
  LLM_DEPLOYMENTS: z.string().trim().transform((text, ctx) => {
    const parsed = parseDeployments(text);
    if (typeof parsed === "string") {
      ctx.addIssue({ code: "custom", message: parsed });
      return z.NEVER;
    }
    return parsed;
  }).optional(),
  MAIL_PROVIDER: z.enum(["resend", "log"], "must be resend or log").optional(),
  RESEND_API_KEY: z.string().min(1).optional(),
  RESEND_BASE_URL: url(["http:", "https:"], "https://api.resend.com").default("https://api.resend.com"),
  MAIL_FROM: z.string().trim().min(3, "must be an email address").default("summaries@localhost"),
  IDEMPOTENCY_LOCK_TTL_S: int(1).default(30),
  IDEMPOTENCY_RESULT_TTL_S: int(1).default(86400),
  CLAIM_IDLE_MS: int(100).default(120000),
  MAX_DELIVERIES: int(1).default(5),
  WORKER_CONCURRENCY: int(1, 10000).default(32),
  JOB_BUDGET_S: seconds.default(60),
  LLM_CALL_TIMEOUT_S: seconds.default(20),
  LLM_MAX_ATTEMPTS: int(1, 100).default(4),
  LLM_RPM: int(1).optional(),
  LLM_TPM: int(1).optional(),
  LLM_BREAKER_COOLDOWN_S: seconds.default(30),
  // A run moves to its task's next model only when every deployment of its model is unavailable or paused longer.
  LLM_FALLBACK_AFTER_S: z.string().trim().regex(/^\d+(\.\d+)?$/, "must be a number of seconds")
    .transform(Number).pipe(z.number().max(86400, "must be at most 86400")).default(10),
  TENANT_MAX_IN_FLIGHT: int(1).optional(),
  INTAKE_MAX_QUEUED: int(1).optional(),
  SUMMARY_RETENTION_S: int(60).optional(),
  MAIL_TENANT_HOURLY_LIMIT: int(1).optional(),
  WEBHOOK_TENANT_HOURLY_LIMIT: int(1).optional(),
  INTAKE_MAX_QUEUED_PER_TENANT: int(1).optional(),
  RELAY_BATCH: int(1, 10000).default(20),
  RELAY_MAX_ATTEMPTS: int(1).default(10),
  MAIL_SEND_TIMEOUT_S: seconds.default(10),
  OUTBOX_RETENTION_S: int(60).default(7 * 24 * 3600),
  MAX_BODY_BYTES: int(64).default(1048576),
  TENANT_BODY_BYTES_IN_FLIGHT: int(0).default(0),
  LOG_LEVEL: z.enum(["debug", "info", "warn", "error"], "must be debug, info, warn or error").default("info"),
  METRICS_PORT: int(0, 65535).optional(),
  METRICS_TOKEN: z.string().trim().min(16, "must be at least 16 characters").optional(),
  GATEWAY_SECRET: z.string().trim().min(16, "must be at least 16 characters").optional(),
  MODEL_ATTEMPTS_RETENTION_S: int(60).default(30 * 24 * 3600),
  LLM_PRICE_IN_PER_MTOK: z.string().trim().regex(/^\d+(\.\d+)?$/, "must be a price, such as 0.40")
    .transform(Number).optional(),
  LLM_PRICE_OUT_PER_MTOK: z.string().trim().regex(/^\d+(\.\d+)?$/, "must be a price, such as 1.60")
    .transform(Number).optional(),
  // Prices per model, JSON {"MODEL": {"in", "out", "batch_in"?, "batch_out"?}} in USD per million tokens.
  LLM_PRICES: z.string().trim().transform((text, ctx) => {
    const parsed = parsePrices(text);
    if (typeof parsed === "string") {
      ctx.addIssue({ code: "custom", message: parsed });
      return z.NEVER;
    }
    return parsed;
  }).optional(),
  // The cache's default for tasks that do not set cache_ttl_s; 0 = off.
  RESULT_CACHE_TTL_S: int(0, 365 * 24 * 3600).default(0),
  ADMIN_TOKEN: z.string().trim().min(16, "must be at least 16 characters").optional(),
  WEBHOOK_ALLOW_HTTP: bool.default(false),
  WEBHOOK_ALLOW_PRIVATE: bool.default(false),
  // Replicated before promised: WAIT for this many replicas after each intake and dead-letter replay (0: no WAIT),
  // at most this long (WAIT's own timeout 0 would mean forever, so 0 is refused).
  REDIS_MIN_REPLICAS_ACK: int(0, 100).default(0),
  REDIS_ACK_TIMEOUT_MS: int(1, 60_000).default(500),
  // Bytes of task definitions (compact JSON, every version of every task) one tenant may store; a PUT past it is
  // a 409. Unset: 64 MiB (TASK_LIMITS in src/jobs/task_store.ts).
  TASK_TENANT_MAX_BYTES: int(256 * 1024).optional(),
  // A tenant's PUTs that would store a new task version (each compiles its schemas): this many a minute, up to
  // TASK_PUT_BURST at once; over it (no token left), every PUT of the tenant is a 429 with Retry-After until one
  // is back. A PUT identical to the latest version takes no token. Unset: 60 a minute, 20 at once (TASK_PUT_RATE
  // in src/jobs/task_store.ts).
  TASK_PUTS_PER_MINUTE: int(1, 60_000).optional(),
  TASK_PUT_BURST: int(1, 10_000).optional(),
  // How long /v1/chat/completions and a foreground /v1/responses wait for their run before answering 408.
  OPENAI_COMPAT_WAIT_S: int(1, 600).default(60),
  // Batch API (issue 43): a provider batch closes at this many runs or this many seconds of collecting; the runs an
  // expired or failed batch left unfinished go online or fail.
  BATCH_MAX_RUNS: int(1, 50_000).default(5000),
  BATCH_MAX_WAIT_S: int(1, 24 * 3600).default(300),
  BATCH_ON_EXPIRY: z.enum(["online", "fail"], "must be online or fail").default("online"),
});

/** The names of every environment variable the service reads. */
export const CONFIG_VARIABLES: readonly string[] = Object.keys(schema.shape);

type Raw = z.output<typeof schema>;

/** Validated configuration, with provider choices resolved and the deployments' keys read. */
export type Config = Omit<Raw, "LLM_PROVIDER" | "MAIL_PROVIDER" | "LLM_DEPLOYMENTS"> & {
  LLM_PROVIDER: "openai" | "extractive";
  MAIL_PROVIDER: "resend" | "log";
  LLM_DEPLOYMENTS?: readonly ConfiguredDeployment[];
};

/** A configuration value that stops the process at start-up. */
export class ConfigError extends Error {
  constructor(readonly variable: string, message: string) {
    super(message);
    this.name = "ConfigError";
  }
}

// LLM_DEPLOYMENTS holds no key, but one pasted into it by mistake must not be printed either.
const SECRETS = new Set([
  "OPENAI_API_KEY",
  "RESEND_API_KEY",
  "METRICS_TOKEN",
  "GATEWAY_SECRET",
  "ADMIN_TOKEN",
  "LLM_DEPLOYMENTS",
]);

/**
 * Parses the service configuration from an environment record.
 * Empty strings count as unset, so `PORT=` falls back to the default.
 * The deployments' keys are read from the variables `LLM_DEPLOYMENTS` names (see {@linkcode deploymentKeyVariables}).
 * @throws {ConfigError} naming the first invalid variable.
 */
export function parseConfig(env: Record<string, string | undefined>): Config {
  const input: Record<string, string> = {};
  for (const name of CONFIG_VARIABLES) {
    const value = env[name];
    if (value !== undefined && value !== "") input[name] = value;
  }
  const parsed = schema.safeParse(input);
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    const variable = String(issue.path[0]);
    const value = input[variable] ?? "";
    // Never echo a secret: API keys, or a URL that may carry a password.
    const got = SECRETS.has(variable) || value.includes("@") ? "" : ` (got ${JSON.stringify(value)})`;
    // A message about one element of a list (LLM_DEPLOYMENTS) begins with its index: `LLM_DEPLOYMENTS[1] ...`.
    const space = issue.message.startsWith("[") ? "" : " ";
    throw new ConfigError(variable, `Cannot start: ${variable}${space}${issue.message}${got}`);
  }
  const raw = parsed.data;
  if (raw.AUTH_MODE === "trusted-header" && !raw.GATEWAY_SECRET) {
    // Without it, any process that can reach the port chooses its tenant.
    throw new ConfigError(
      "GATEWAY_SECRET",
      "Cannot start: AUTH_MODE=trusted-header requires GATEWAY_SECRET, the secret your gateway sends as X-Gateway-Secret",
    );
  }
  if (raw.SUMMARY_RETENTION_S !== undefined && raw.SUMMARY_RETENTION_S < raw.IDEMPOTENCY_RESULT_TTL_S) {
    // A key still replaying its answer must not name a job whose summary is gone: a retry would run it again.
    throw new ConfigError(
      "SUMMARY_RETENTION_S",
      `Cannot start: SUMMARY_RETENTION_S must be at least IDEMPOTENCY_RESULT_TTL_S (${raw.IDEMPOTENCY_RESULT_TTL_S})`,
    );
  }
  for (const limit of ["MAIL_TENANT_HOURLY_LIMIT", "WEBHOOK_TENANT_HOURLY_LIMIT"] as const) {
    if (raw[limit] === undefined || raw.OUTBOX_RETENTION_S >= 3600) continue;
    // The hourly cap counts the sent rows still in the outbox: rows deleted within the hour would not count.
    throw new ConfigError(
      "OUTBOX_RETENTION_S",
      `Cannot start: ${limit} counts the last hour's sent outbox rows, so OUTBOX_RETENTION_S ` +
        `must be at least 3600 while it is set (got ${raw.OUTBOX_RETENTION_S})`,
    );
  }
  checkPostgresTarget(raw.DATABASE_URL);
  const llm = llmProvider(raw);
  const deployments = raw.LLM_DEPLOYMENTS && withKeys(raw.LLM_DEPLOYMENTS, env);
  const mail = raw.MAIL_PROVIDER ?? (raw.RESEND_API_KEY ? "resend" : "log");
  if (mail === "resend" && !raw.RESEND_API_KEY) {
    throw new ConfigError("RESEND_API_KEY", "Cannot start: RESEND_API_KEY must be set when MAIL_PROVIDER=resend");
  }
  const { LLM_DEPLOYMENTS: _, ...rest } = raw;
  return { ...rest, LLM_PROVIDER: llm, MAIL_PROVIDER: mail, ...(deployments ? { LLM_DEPLOYMENTS: deployments } : {}) };
}

/**
 * LLM_PROVIDER, resolved: `openai` when LLM_DEPLOYMENTS or OPENAI_API_KEY is set, else `extractive`.
 * @throws {ConfigError} for `openai` with neither, for `extractive` with deployments, and for LLM_RPM or LLM_TPM
 * with deployments (each deployment has its own `rpm` and `tpm`: those would be ignored).
 */
function llmProvider(raw: Raw): Config["LLM_PROVIDER"] {
  if (raw.LLM_DEPLOYMENTS) {
    if (raw.LLM_PROVIDER === "extractive") {
      throw new ConfigError(
        "LLM_PROVIDER",
        "Cannot start: LLM_PROVIDER=extractive is the embedded model, which takes no LLM_DEPLOYMENTS; unset one of them",
      );
    }
    for (const limit of ["LLM_RPM", "LLM_TPM"] as const) {
      if (raw[limit] === undefined) continue;
      throw new ConfigError(
        limit,
        `Cannot start: ${limit} limits the one deployment OPENAI_* names; with LLM_DEPLOYMENTS set, give each ` +
          `deployment its own "${limit.slice(4).toLowerCase()}" instead`,
      );
    }
    return "openai";
  }
  const llm = raw.LLM_PROVIDER ?? (raw.OPENAI_API_KEY ? "openai" : "extractive");
  if (llm === "openai" && !raw.OPENAI_API_KEY) {
    throw new ConfigError(
      "OPENAI_API_KEY",
      "Cannot start: OPENAI_API_KEY must be set when LLM_PROVIDER=openai (or set LLM_DEPLOYMENTS)",
    );
  }
  return llm;
}

/** Replaces the password in a connection URL (a multi-host one too), so it can be printed. */
export function redactUrl(value: string): string {
  try {
    const u = new URL(value);
    if (u.password) u.password = "***";
    return u.toString();
  } catch {
    // `new URL` refuses a list of hosts; the user-info is everything between "//" and the first "@".
    const multiHost = /^([a-z][a-z0-9+.-]*:\/\/)(?:([^:@/]*):[^@/]*@)?([^/?#]*,[^/?#]*)(.*)$/i.exec(value);
    if (!multiHost) return "(unparseable URL)";
    const [, scheme, user, hosts, rest] = multiHost;
    return `${scheme}${user === undefined ? "" : `${user}:***@`}${hosts}${rest}`;
  }
}

// ---- Redis behind Sentinel: REDIS_URL=redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/DB] ----

/** The port of a sentinel named without one. */
export const SENTINEL_DEFAULT_PORT = 26379;

/** REDIS_URL's Sentinel form, parsed: whom to ask, for which service, and how to log in to the data nodes. */
export interface SentinelUrl {
  /** Host names lower-cased; an IPv6 address in brackets. */
  sentinels: { host: string; port: number }[];
  /** The name the sentinels monitor the master under (`SENTINEL MONITOR <service> ...`). */
  service: string;
  db: number;
  /** For the master and replicas; the sentinels are asked without credentials. */
  username?: string;
  password?: string;
}

const SENTINEL_SCHEME = "redis+sentinel://";
const SENTINEL_EXAMPLE = "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster/0";
const SENTINEL_HOST = /^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::(\d{1,5}))?$/;

/** Whether REDIS_URL is in the Sentinel form. */
export function isSentinelUrl(value: string): boolean {
  return value.trim().toLowerCase().startsWith(SENTINEL_SCHEME);
}

/**
 * Parses `redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/DB]`.
 * @throws {TypeError} naming what is missing or wrong (no sentinel hosts, no SERVICE, a bad port or DB).
 */
export function parseSentinelUrl(value: string): SentinelUrl {
  const text = value.trim();
  if (!isSentinelUrl(text)) throw new TypeError(`is not a ${SENTINEL_SCHEME} URL`);
  if (/[?#\s]/.test(text)) throw new TypeError(`takes no query, fragment or spaces (for example ${SENTINEL_EXAMPLE})`);
  const rest = text.slice(SENTINEL_SCHEME.length);
  const slash = rest.indexOf("/");
  const authority = slash < 0 ? rest : rest.slice(0, slash);
  const at = authority.lastIndexOf("@");
  const [user = "", pass] = at < 0 ? [] : authority.slice(0, at).split(/:(.*)/s, 2);
  const hosts = (at < 0 ? authority : authority.slice(at + 1)).split(",").filter((host) => host !== "");
  if (hosts.length === 0) throw new TypeError(`names no sentinel host (for example ${SENTINEL_EXAMPLE})`);
  const sentinels = hosts.map((host) => {
    const match = SENTINEL_HOST.exec(host);
    const port = Number(match?.[2] ?? SENTINEL_DEFAULT_PORT);
    if (!match || port < 1 || port > 65535) {
      throw new TypeError(`names a sentinel that is not host:port (got "${host}"; for example ${SENTINEL_EXAMPLE})`);
    }
    return { host: match[1]!.toLowerCase(), port };
  });
  const [service = "", db = "0", ...extra] = slash < 0 ? [] : rest.slice(slash + 1).split("/");
  if (service === "") {
    throw new TypeError(`names no SERVICE, the master's name at the sentinels (for example ${SENTINEL_EXAMPLE})`);
  }
  if (!/^\d{1,9}$/.test(db || "0") || extra.some((segment) => segment !== "")) {
    throw new TypeError(
      `has a bad DB (${JSON.stringify([db, ...extra].join("/"))}): after /SERVICE only a database number may follow ` +
        `(for example ${SENTINEL_EXAMPLE})`,
    );
  }
  const decode = (part: string, what: string) => {
    try {
      return decodeURIComponent(part);
    } catch {
      throw new TypeError(`has a malformed percent-encoding in its ${what}`);
    }
  };
  return {
    sentinels,
    service: decode(service, "SERVICE"),
    db: Number(db || "0"),
    username: user ? decode(user, "user name") : undefined,
    password: pass ? decode(pass, "password") : undefined,
  };
}

function checkSentinelUrl(value: string, ctx: z.RefinementCtx): void {
  if (!isSentinelUrl(value)) return;
  try {
    parseSentinelUrl(value);
  } catch (error) {
    ctx.addIssue({ code: "custom", message: (error as Error).message });
  }
}

/**
 * The `host:port` of each host a Postgres URL names, as postgres.js reads
 * them: one host, or a comma-separated list (a host without a port gets the
 * first host's, else 5432). An IPv6 literal is taken only alone: postgres.js
 * splits a list at every colon.
 * @returns undefined when `value` is not such a URL.
 */
export function postgresHosts(value: string): string[] | undefined {
  const match = /^postgres(?:ql)?:\/\/(?:[^@/?#]*@)?([^/?#]*)/i.exec(value);
  if (!match) return undefined;
  const parts = match[1]!.split(",");
  try {
    const hostsAt = match[0].length - match[1]!.length;
    const first = new URL(value.slice(0, hostsAt) + parts[0] + value.slice(match[0].length));
    if (parts.length === 1) return [`${first.hostname}:${first.port || "5432"}`];
    return parts.map((part) => {
      if (!/^[^:[\]]+(:\d{1,5})?$/.test(part)) throw new TypeError(`not a host:port: ${part}`);
      const u = new URL(`postgres://${part}/`);
      return `${u.hostname}:${u.port || first.port || "5432"}`;
    });
  } catch {
    return undefined;
  }
}

/** The `target_session_attrs` values under which every connection lands on a server that takes writes. */
const WRITABLE_TARGETS = ["read-write", "primary"];

/**
 * Several hosts are only safe when the client picks the writable one;
 * otherwise the pool would connect to whichever answers first, a standby
 * too, and every write there fails.
 * @throws {ConfigError} for several hosts without `target_session_attrs=read-write` (or `primary`), or any
 * other target (which would aim the service at a standby).
 */
function checkPostgresTarget(databaseUrl: string): void {
  const target = new URLSearchParams(/\?([^#]*)/.exec(databaseUrl)?.[1]).get("target_session_attrs") ?? undefined;
  const hosts = postgresHosts(databaseUrl)!;
  if (target === undefined ? hosts.length === 1 : WRITABLE_TARGETS.includes(target)) return;
  throw new ConfigError(
    "DATABASE_URL",
    target === undefined
      ? `Cannot start: DATABASE_URL lists ${hosts.length} hosts (${hosts.join(",")}) but no ` +
        "target_session_attrs: add ?target_session_attrs=read-write, or writes could go to a standby"
      : `Cannot start: DATABASE_URL's target_session_attrs must be read-write or primary (got "${target}"): ` +
        "the service writes, and a standby refuses writes",
  );
}

// ---- LLM_DEPLOYMENTS: the OpenAI-compatible servers model calls go to, each with its own key, models and limits ----

export type { ConfiguredDeployment };

/**
 * Where a deployment's key may live: `OPENAI_API_KEY`, or a variable whose name begins with this. The launch task
 * may read any such variable (`--allow-env=...,LLM_KEY_*` in deno.json), and each process is granted exactly the
 * ones its deployments name, so no deployment can make a process read another variable.
 */
export const DEPLOYMENT_KEY_PREFIX = "LLM_KEY_";

/**
 * The names a deployment's `api_key_env` may take. Only capitals, digits and `_`: the name goes into an
 * `--allow-env=` list, where a comma would grant one more variable.
 */
const KEY_VARIABLE = new RegExp(`^(?:OPENAI_API_KEY|${DEPLOYMENT_KEY_PREFIX}[A-Z0-9_]{1,64})$`);
const DEPLOYMENT_NAME = /^[A-Za-z0-9._-]{1,64}$/;
const DEPLOYMENTS_EXAMPLE = '[{"name": "openai", "base_url": "https://api.openai.com/v1", ' +
  '"api_key_env": "LLM_KEY_OPENAI", "models": ["gpt-4.1-mini"]}]';

/** A field's message: `missing` when absent, else `wrong`. */
const field = (wrong: string, missing = "is missing") => ({
  error: (issue: { input?: unknown }) => issue.input === undefined ? missing : wrong,
});

const positiveWhole = z.number(field("must be a whole number of at least 1")).int(
  "must be a whole number of at least 1",
)
  .min(1, "must be a whole number of at least 1");

const deploymentSchema = z.strictObject({
  name: z.string(field("must be a string")).regex(
    DEPLOYMENT_NAME,
    "must be 1 to 64 letters, digits, '.', '_' or '-'",
  ),
  base_url: z.string(field("must be a string")).refine(
    (value) => url(["http:", "https:"], "").safeParse(value).success && value.trim() === value,
    "is not an http:// or https:// URL (for example https://api.openai.com/v1)",
  ).refine(
    // The URL is printed (logs, `provider status`); the key goes in a header, from api_key_env's variable.
    (value) => !URL.canParse(value) || (({ username, password }) => !username && !password)(new URL(value)),
    "must carry no user name or password: the key belongs in the variable api_key_env names",
  ),
  api_key_env: z.string(field("must be a string")).regex(
    KEY_VARIABLE,
    `must name OPENAI_API_KEY or a variable whose name is ${DEPLOYMENT_KEY_PREFIX} followed by capitals, digits ` +
      "or '_' (the variable that holds the key, not the key)",
  ),
  models: z.array(
    z.string(field("must be a string")).min(1, "must not be empty").max(256, "must be at most 256 characters")
      .refine((model) => model.trim() === model, "must have no leading or trailing spaces"),
    field("must be a list of model names"),
  ).min(1, "must list at least one model").refine(
    (models) => new Set(models).size === models.length,
    "lists a model twice",
  ),
  weight: positiveWhole.default(1),
  rpm: positiveWhole.optional(),
  tpm: positiveWhole.optional(),
  batch: z.boolean(field("must be true or false")).default(false),
}, {
  error: (issue) =>
    issue.code === "unrecognized_keys"
      ? `has an unknown field ${issue.keys.map((key) => JSON.stringify(key)).join(", ")} (it takes name, ` +
        "base_url, api_key_env, models, weight, rpm, tpm, batch)"
      : `must be an object, for example ${DEPLOYMENTS_EXAMPLE.slice(1, -1)}`,
});

type ParsedDeployment = Omit<ConfiguredDeployment, "api_key">;

/**
 * Parses `LLM_DEPLOYMENTS` (its keys are read later, from the variables it names).
 * @returns the deployments, or a message naming the element and the field that is wrong. It quotes no string value
 * but a valid name (a key pasted where a variable's name belongs would be printed), only field names and numbers.
 */
function parseDeployments(text: string): ParsedDeployment[] | string {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return `is not JSON; for example ${DEPLOYMENTS_EXAMPLE}`;
  }
  if (!Array.isArray(value)) return `must be a JSON array of deployments, for example ${DEPLOYMENTS_EXAMPLE}`;
  if (value.length === 0) return "must list at least one deployment (unset it for the one OPENAI_* names)";
  const deployments: ParsedDeployment[] = [];
  for (const [i, element] of value.entries()) {
    const parsed = deploymentSchema.safeParse(element, { reportInput: true });
    if (!parsed.success) {
      const issue = parsed.error.issues[0]!;
      const path = issue.path.map((part) => typeof part === "number" ? `[${part}]` : `.${String(part)}`).join("");
      const got = typeof issue.input === "number" || typeof issue.input === "boolean" ? ` (got ${issue.input})` : "";
      return `[${i}]${nameOf(element)}${path} ${issue.message}${got}`;
    }
    const earlier = deployments.findIndex((d) => d.name === parsed.data.name);
    if (earlier >= 0) {
      return `[${i}] has the name "${parsed.data.name}" of LLM_DEPLOYMENTS[${earlier}]: each deployment needs its own`;
    }
    deployments.push(parsed.data);
  }
  return deployments;
}

/** ` ("name")` for an element with a valid name, to say which deployment a message is about. */
function nameOf(element: unknown): string {
  const name = typeof element === "object" && element !== null ? (element as { name?: unknown }).name : undefined;
  return typeof name === "string" && DEPLOYMENT_NAME.test(name) ? ` ("${name}")` : "";
}

/**
 * The key variables `LLM_DEPLOYMENTS` names, as far as it can be read: what the launcher reads besides
 * {@linkcode CONFIG_VARIABLES}. Only names a deployment may use; anything unreadable is parseConfig's to report.
 */
export function deploymentKeyVariables(text: string | undefined): string[] {
  if (text === undefined || text.trim() === "") return [];
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return [];
  }
  if (!Array.isArray(value)) return [];
  const names = value.map((element) => (element as { api_key_env?: unknown } | null)?.api_key_env);
  return [...new Set(names.filter((name): name is string => typeof name === "string" && KEY_VARIABLE.test(name)))];
}

/**
 * Each deployment with its key, read from `env`.
 * @throws {ConfigError} naming the key variable that is unset or empty, and the deployment that names it.
 */
function withKeys(deployments: ParsedDeployment[], env: Record<string, string | undefined>): ConfiguredDeployment[] {
  return deployments.map((deployment, i) => {
    const key = env[deployment.api_key_env];
    if (key === undefined || key.trim() === "") {
      throw new ConfigError(
        deployment.api_key_env,
        `Cannot start: ${deployment.api_key_env} is ${key === undefined ? "not set" : "empty"}, and ` +
          `LLM_DEPLOYMENTS[${i}] ("${deployment.name}") names it as its api_key_env`,
      );
    }
    return { ...deployment, api_key: key };
  });
}
