/**
 * The task API: `PUT /v1/tasks/{name}` stores a definition (a new version
 * when it changed), `GET /v1/tasks` lists the tenant's tasks a page at a
 * time (their latest version's number, time and size, never a definition),
 * `GET /v1/tasks/{name}` and `GET /v1/tasks/{name}/versions/{v}` read one
 * version. A tenant sees only its own tasks, and the built-in `summarize`.
 *
 * What a tenant's definitions may cost is bounded: a version's size
 * ({@linkcode DEFINITION_LIMITS}), the bytes a tenant stores and its PUTs
 * that store something ({@linkcode TASK_LIMITS}, {@linkcode TASK_PUT_RATE};
 * over the rate, a PUT is refused before its body is read). A PUT identical
 * to the latest version is answered from the digests before anything is
 * compiled, and takes no token; a new definition is checked on a Worker
 * (`definition_checker.ts`), not on this thread.
 */
import type { Sql } from "postgres";
import { readJsonBody } from "../http/body.ts";
import { HttpError } from "../http/problem.ts";
import { json, Router } from "../http/router.ts";
import {
  latestIfSame,
  measureDefinition,
  putTaskVersion,
  putTokenWait,
  quotaMessage,
  takePutToken,
  TASK_LIMITS,
  TASK_PUT_RATE,
  TaskLimitReached,
  taskList,
  type TaskListEntry,
  type TaskVersion,
  taskVersion,
  tenantTaskUsage,
} from "../jobs/task_store.ts";
import type { Logger } from "../log/logger.ts";
import type { Authenticate } from "../tenants/authenticator.ts";
import { isBuiltIn, type TaskCache } from "./task_cache.ts";
import {
  BUILT_IN_TASK,
  DEFINITION_LIMITS,
  DefinitionRefused,
  SUMMARIZE_DEFINITION,
  TASK_NAME,
  TaskDefinition,
} from "./definition.ts";
import {
  createDefinitionChecker,
  DefinitionCheckBusy,
  type DefinitionChecker,
  DefinitionCheckTimeout,
} from "./definition_checker.ts";

/** What a tenant's PUTs may store, and how often (the store's defaults when unset). */
export interface TaskPutLimits {
  /** Bytes of definitions, every version of every task, per tenant (`TASK_TENANT_MAX_BYTES`). */
  maxTenantBytes: number;
  /** PUTs that store a new version, per tenant and minute (`TASK_PUTS_PER_MINUTE`)... */
  putsPerMinute: number;
  /** ...and at once (`TASK_PUT_BURST`). */
  putBurst: number;
}

/** What the task routes need. */
export interface TaskApiDeps {
  sql: Sql;
  log: Logger;
  authenticate: Authenticate;
  maxBodyBytes: number;
  bodyDeadlineMs?: number;
  /** The run routes' cache of task versions: told when this process stores a new latest version. */
  tasks?: TaskCache;
  /** Checks new definitions on a Worker; one of these routes' own (started on the first check) when unset. */
  definitions?: DefinitionChecker;
  taskLimits?: Partial<TaskPutLimits>;
  /** The models a task may name (`servedModels`: the deployments'); any model when unset. */
  models?: ReadonlySet<string>;
}

/** Pages of `GET /v1/tasks`: `limit` tasks by default, at most `maxLimit` (a tenant's whole 1,000). */
export const TASK_LIST = { defaultLimit: 100, maxLimit: 1_000 } as const;

export const TASKS = "/v1/tasks";
const TASK_PATH = /^\/v1\/tasks\/([^/]+)$/;
const VERSION_PATH = /^\/v1\/tasks\/([^/]+)\/versions\/([^/]+)$/;

/** A task version as the API shows it: its name, version, definition and creation time. */
export function taskDocument(task: Pick<TaskVersion, "name" | "version" | "definition" | "created_at">) {
  return { name: task.name, version: task.version, ...task.definition, created_at: task.created_at.toISOString() };
}

/** The built-in `summarize` task's document. */
function builtInDocument() {
  return { name: BUILT_IN_TASK, version: 1, ...SUMMARIZE_DEFINITION, built_in: true };
}

/** A task as `GET /v1/tasks` lists it. */
function listItem(task: TaskListEntry) {
  const { name, version, created_at, bytes, versions, total_bytes } = task;
  return { name, version, created_at: created_at.toISOString(), bytes, versions, total_bytes };
}

const SUMMARIZE_BYTES = measureDefinition(SUMMARIZE_DEFINITION).bytes;
const BUILT_IN_ITEM = {
  name: BUILT_IN_TASK,
  version: 1,
  bytes: SUMMARIZE_BYTES,
  versions: 1,
  total_bytes: SUMMARIZE_BYTES,
  built_in: true,
};

/** The task API's routes. */
export function taskRoutes(deps: TaskApiDeps): Router {
  const { sql, log, authenticate } = deps;
  const limits: TaskPutLimits = {
    maxTenantBytes: deps.taskLimits?.maxTenantBytes ?? TASK_LIMITS.maxBytesPerTenant,
    putsPerMinute: deps.taskLimits?.putsPerMinute ?? TASK_PUT_RATE.perMinute,
    putBurst: deps.taskLimits?.putBurst ?? TASK_PUT_RATE.burst,
  };
  let own: DefinitionChecker | undefined;
  const checker = () => deps.definitions ?? (own ??= createDefinitionChecker());

  async function putTask(req: Request, name: string): Promise<Response> {
    const tenant = await authenticate(req);
    if (!TASK_NAME.test(name)) {
      throw new HttpError(422, "A task name is a lowercase letter, then up to 63 of a-z, 0-9, _ and -");
    }
    if (isBuiltIn(name)) throw new HttpError(409, `${name} is built in and cannot be changed`);
    // Over its rate, a tenant's PUTs are refused before their bodies are read: a flood of them costs this
    // thread no parsing. (A PUT identical to the latest version takes no token, below.)
    const rate = { perMinute: limits.putsPerMinute, burst: limits.putBurst };
    const waitS = await putTokenWait(sql, tenant, rate);
    if (waitS > 0) throw overRate(limits, waitS);
    const { definition, measured } = definitionOf(
      await readJsonBody(req, deps.maxBodyBytes, { deadlineMs: deps.bodyDeadlineMs }),
      deps.models,
    );
    // Before anything is compiled: a PUT of the latest version again is the usual case (a deploy that PUTs
    // every task), and it costs a digest and one read.
    const latest = await latestIfSame(sql, tenant, name, definition, measured);
    if (latest?.same) return json(200, taskDocument(latest.same));
    const takenWaitS = await takePutToken(sql, tenant, rate);
    if (takenWaitS > 0) throw overRate(limits, takenWaitS);
    await refuseOverLimits(sql, limits, { tenant, name, latest: latest?.version, bytes: measured.bytes });
    await checkDefinition(checker(), measured.json, tenant);
    let put: Awaited<ReturnType<typeof putTaskVersion>>;
    try {
      put = await putTaskVersion(sql, tenant, name, definition, {
        measured,
        maxBytesPerTenant: limits.maxTenantBytes,
      });
    } catch (error) {
      if (error instanceof TaskLimitReached) throw new HttpError(409, error.message);
      throw error;
    }
    const { task, created } = put;
    if (created) {
      deps.tasks?.forgetLatest(tenant, name);
      log.info("task_version_created", { tenant, task: name, version: task.version, bytes: task.bytes });
    }
    const headers: Record<string, string> = created ? { location: `${TASKS}/${name}/versions/${task.version}` } : {};
    return json(created ? 201 : 200, taskDocument(task), headers);
  }

  async function getTask(req: Request, name: string, version?: string): Promise<Response> {
    const tenant = await authenticate(req);
    const v = version === undefined ? undefined : /^[1-9]\d{0,8}$/.test(version) ? Number(version) : NaN;
    if (name === BUILT_IN_TASK && (v === undefined || v === 1)) return json(200, builtInDocument());
    const task = Number.isNaN(v) ? undefined : await taskVersion(sql, tenant, name, v);
    if (!task) {
      throw new HttpError(404, `No task ${name}${version === undefined ? "" : ` version ${version}`} for this tenant`);
    }
    return json(200, taskDocument(task));
  }

  async function listTasks(req: Request): Promise<Response> {
    const tenant = await authenticate(req);
    const { limit, after } = pageOf(req);
    const [rows, usage] = await Promise.all([
      taskList(sql, tenant, { after, limit: limit + 1 }),
      tenantTaskUsage(sql, tenant),
    ]);
    const page = rows.slice(0, limit);
    const next = rows.length > limit ? `${TASKS}?after=${encodeURIComponent(page.at(-1)!.name)}&limit=${limit}` : null;
    return json(200, {
      tasks: [...(after === undefined ? [BUILT_IN_ITEM] : []), ...page.map(listItem)],
      next,
      usage: {
        tasks: usage.tasks,
        max_tasks: TASK_LIMITS.maxTasksPerTenant,
        bytes: usage.bytes,
        max_bytes: limits.maxTenantBytes,
      },
    });
  }

  return new Router()
    .on(TASKS, { GET: listTasks })
    .on(TASK_PATH, {
      GET: (req, { params }) => getTask(req, params[0]!),
      PUT: (req, { params }) => putTask(req, params[0]!),
    }, "/v1/tasks/{name}")
    .on(
      VERSION_PATH,
      { GET: (req, { params }) => getTask(req, params[0]!, params[1]!) },
      "/v1/tasks/{name}/versions/{version}",
    );
}

/**
 * A PUT's body as a definition, measured.
 * @throws {HttpError} 422 for a body that is no definition, one over {@linkcode DEFINITION_LIMITS}, or one naming
 * a model not in `models` (when set).
 */
function definitionOf(raw: unknown, models: ReadonlySet<string> | undefined) {
  const parsed = TaskDefinition.safeParse(raw);
  if (!parsed.success) {
    const errors = parsed.error.issues.map((i) => ({ pointer: pointerOf(i.path), message: i.message }));
    throw new HttpError(422, "The task definition failed validation", {}, { extra: { errors } });
  }
  const definition = parsed.data;
  const measured = measureDefinition(definition);
  if (measured.bytes > DEFINITION_LIMITS.maxBytes) {
    throw refused(
      "",
      `The definition is ${measured.bytes} bytes of JSON with its schemas (UTF-8, compact, defaults filled in); ` +
        `the limit is ${DEFINITION_LIMITS.maxBytes}`,
    );
  }
  // Only a model a deployment serves: any other name would be called at a price nobody set (and fail).
  const named = definition.model === undefined ? [] : [definition.model].flat();
  const unserved = models ? named.findIndex((m) => !models.has(m)) : -1;
  if (unserved >= 0) {
    throw refused(
      Array.isArray(definition.model) ? `/model/${unserved}` : "/model",
      `Model ${JSON.stringify(named[unserved])} is not served here; the models served are ${
        [...models!].sort().join(", ")
      }`,
    );
  }
  return { definition, measured };
}

/**
 * Checks a new definition (its compact JSON) on the checker's Worker.
 * @throws {HttpError} 422 for a definition it refuses or that took too long to check, 503 when it is busy.
 */
async function checkDefinition(checker: DefinitionChecker, json: string, tenant: string): Promise<void> {
  try {
    await checker.check(json, tenant);
  } catch (error) {
    if (error instanceof DefinitionRefused) throw refused(error.pointer, error.message);
    if (error instanceof DefinitionCheckTimeout) throw refused("", error.message);
    if (error instanceof DefinitionCheckBusy) {
      throw new HttpError(503, error.message, { "retry-after": "1" }, { shed: true });
    }
    throw error;
  }
}

/** The 429 of a tenant over its rate of new versions. */
function overRate(limits: TaskPutLimits, waitS: number): HttpError {
  return new HttpError(
    429,
    `This tenant may store ${limits.putsPerMinute} new task versions a minute, ${limits.putBurst} at once; ` +
      `try again in ${waitS} s`,
    { "retry-after": String(waitS) },
  );
}

/**
 * The 409 a new version would get from the store, before its definition is checked: a tenant at a cap is
 * told so without a compile. The store decides again under its locks.
 */
async function refuseOverLimits(
  sql: Sql,
  limits: TaskPutLimits,
  { tenant, name, latest, bytes }: { tenant: string; name: string; latest: number | undefined; bytes: number },
) {
  if (latest !== undefined && latest >= TASK_LIMITS.maxVersionsPerTask) {
    throw new HttpError(409, `Task ${name} has ${latest} versions, the most one task may have`);
  }
  const usage = await tenantTaskUsage(sql, tenant);
  if (latest === undefined && usage.tasks >= TASK_LIMITS.maxTasksPerTenant) {
    throw new HttpError(409, `This tenant has ${usage.tasks} tasks, the most one tenant may have`);
  }
  if (usage.bytes + bytes > limits.maxTenantBytes) {
    throw new HttpError(409, quotaMessage(usage.bytes, bytes, limits.maxTenantBytes));
  }
}

/** The page `GET /v1/tasks` asks for: `limit` (1..max) and `after` (a task name); a 400 for anything else. */
function pageOf(req: Request): { limit: number; after?: string } {
  const query = new URL(req.url).searchParams;
  for (const name of query.keys()) {
    if (name !== "limit" && name !== "after") {
      throw new HttpError(400, `Unknown query parameter "${name}"; only limit and after are read`);
    }
  }
  if (query.getAll("limit").length > 1 || query.getAll("after").length > 1) {
    throw new HttpError(400, "Give limit and after at most once each");
  }
  const limitText = query.get("limit");
  const limit = limitText === null ? TASK_LIST.defaultLimit : /^\d{1,4}$/.test(limitText) ? Number(limitText) : 0;
  if (!(limit >= 1 && limit <= TASK_LIST.maxLimit)) {
    throw new HttpError(
      400,
      `limit is a whole number from 1 to ${TASK_LIST.maxLimit} (got ${JSON.stringify(limitText)})`,
    );
  }
  const after = query.get("after") ?? undefined;
  if (after !== undefined && !TASK_NAME.test(after)) {
    throw new HttpError(400, `after is a task name, the last of the page before (got ${JSON.stringify(after)})`);
  }
  return { limit, after };
}

/** A 422 naming the place in the body. */
function refused(pointer: string, message: string): HttpError {
  return new HttpError(422, message, {}, { extra: { errors: [{ pointer, message }] } });
}

/** A zod issue's path as a JSON pointer into the body. */
function pointerOf(path: PropertyKey[]): string {
  return path.map((p) => `/${String(p).replace(/~/g, "~0").replace(/\//g, "~1")}`).join("");
}
