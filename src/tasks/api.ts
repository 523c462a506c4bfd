/**
 * The task API: `PUT /v1/tasks/{name}` stores a definition (a new version
 * when it changed), `GET /v1/tasks`, `GET /v1/tasks/{name}` and
 * `GET /v1/tasks/{name}/versions/{v}` read them. A tenant sees only its own
 * tasks, and the built-in `summarize`.
 */
import type { Sql } from "postgres";
import { readJsonBody } from "../http/body.ts";
import { HttpError } from "../http/problem.ts";
import { json, Router } from "../http/router.ts";
import { latestTasks, putTaskVersion, TaskLimitReached, type TaskVersion, taskVersion } from "../jobs/task_store.ts";
import type { Logger } from "../log/logger.ts";
import type { Authenticate } from "../tenants/authenticator.ts";
import type { TaskCache } from "./task_cache.ts";
import {
  BUILT_IN_TASK,
  checkDefinition,
  DefinitionRefused,
  SUMMARIZE_DEFINITION,
  TASK_NAME,
  TaskDefinition,
} from "./definition.ts";

/** What the task routes need. */
export interface TaskApiDeps {
  sql: Sql;
  log: Logger;
  authenticate: Authenticate;
  maxBodyBytes: number;
  bodyDeadlineMs?: number;
  /** The run routes' cache of task versions: told when this process stores a new latest version. */
  tasks?: TaskCache;
}

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

/** The task API's routes. */
export function taskRoutes(deps: TaskApiDeps): Router {
  const { sql, log, authenticate } = deps;

  async function putTask(req: Request, name: string): Promise<Response> {
    const tenant = await authenticate(req);
    if (!TASK_NAME.test(name)) {
      throw new HttpError(404, "A task name is a lowercase letter, then up to 63 of a-z, 0-9, _ and -");
    }
    if (name === BUILT_IN_TASK) throw new HttpError(409, `${BUILT_IN_TASK} is built in and cannot be changed`);
    const raw = await readJsonBody(req, deps.maxBodyBytes, { deadlineMs: deps.bodyDeadlineMs });
    const parsed = TaskDefinition.safeParse(raw);
    if (!parsed.success) {
      const errors = parsed.error.issues.map((i) => ({ pointer: pointerOf(i.path), message: i.message }));
      throw new HttpError(422, "The task definition failed validation", {}, { extra: { errors } });
    }
    try {
      checkDefinition(parsed.data);
    } catch (error) {
      if (!(error instanceof DefinitionRefused)) throw error;
      throw new HttpError(422, error.message, {}, {
        extra: { errors: [{ pointer: error.pointer, message: error.message }] },
      });
    }
    let put: Awaited<ReturnType<typeof putTaskVersion>>;
    try {
      put = await putTaskVersion(sql, tenant, name, parsed.data);
    } catch (error) {
      if (error instanceof TaskLimitReached) throw new HttpError(409, error.message);
      throw error;
    }
    const { task, created } = put;
    if (created) {
      deps.tasks?.forgetLatest(tenant, name);
      log.info("task_version_created", { tenant, task: name, version: task.version });
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
    const tasks = await latestTasks(sql, tenant);
    return json(200, { tasks: [builtInDocument(), ...tasks.map(taskDocument)] });
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

/** A zod issue's path as a JSON pointer into the body. */
function pointerOf(path: PropertyKey[]): string {
  return path.map((p) => `/${String(p).replace(/~/g, "~0").replace(/\//g, "~1")}`).join("");
}
