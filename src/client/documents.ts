/**
 * The documents the Oncely API sends and takes, written by hand so that the
 * client stands alone (no zod, nothing from the service's own modules).
 * `/work/shared/CONTRACT.md` and `GET /openapi.json` are the reference.
 */

/** A JSON Schema (2020-12): an object of keywords, or `true`/`false`. */
export type JsonSchema = boolean | { [keyword: string]: unknown };

/** One reason a body failed validation. */
export interface ProblemIssue {
  /** A JSON pointer into the body (task definitions, run inputs). */
  pointer?: string;
  /** A dotted path into the body (summaries). */
  path?: string;
  message: string;
}

/** An RFC 9457 problem document: every error response's body. */
export interface Problem {
  type: string;
  title: string;
  status: number;
  detail?: string;
  /** What failed validation, first failure first (422s). */
  errors?: ProblemIssue[];
  /** A tenant's exhausted budget (429 `Budget exhausted`). */
  budget?: { period: string; limit: number; spent: number; unit: string };
  [extension: string]: unknown;
}

/** The body of `PUT /v1/tasks/{name}`. */
export interface TaskDefinition {
  /** A template: `{{input.a.b}}` is replaced by that input value. */
  prompt: string;
  system?: string;
  /** The preference order; the deployment's default when unset. */
  model?: string | string[];
  /** Must describe an object. */
  input_schema: { [keyword: string]: unknown };
  /** With one, the run's output is the parsed JSON value. */
  output_schema?: JsonSchema;
  /** 1..16384; 1024 when unset. */
  max_output_tokens?: number;
  temperature?: number;
  cache_ttl_s?: number;
}

/** One stored version of a task, as `GET /v1/tasks/{name}` shows it. */
export interface Task extends TaskDefinition {
  name: string;
  version: number;
  max_output_tokens: number;
  /** ISO 8601; absent for the built-in `summarize`. */
  created_at?: string;
  /** True for `summarize`, which every tenant has. */
  built_in?: boolean;
}

/** A task in `GET /v1/tasks`: its latest version's number, time and size, without the definition. */
export interface TaskListItem {
  name: string;
  /** The latest version. */
  version: number;
  /** ISO 8601, when the latest version was stored; absent for the built-in `summarize`. */
  created_at?: string;
  /** The latest version's definition, in UTF-8 bytes of compact JSON. */
  bytes: number;
  versions: number;
  /** Every version's definition, in bytes, added up. */
  total_bytes: number;
  /** True for `summarize`, which every tenant has. */
  built_in?: boolean;
}

/** One page of `GET /v1/tasks`. */
export interface TaskList {
  tasks: TaskListItem[];
  /** The next page's path, null on the last. */
  next: string | null;
  /** The tenant's tasks and their bytes against what it may store. */
  usage: { tasks: number; max_tasks: number; bytes: number; max_bytes: number };
}

/** Where a result goes: an email address, or a URL that receives a signed Standard Webhook. */
export type Notify = string | { webhook: string };

/** A run's status; every one but `queued` is final. */
export type RunStatus = "queued" | "done" | "failed" | "cancelled" | "expired";

/** The statuses a run never leaves. */
export const FINISHED_RUN_STATUSES: ReadonlySet<RunStatus> = new Set(["done", "failed", "cancelled", "expired"]);

/** `GET /v1/runs/{run_id}`. A summary job is a run of `summarize`, its `output` the summary. */
export interface Run<Output = unknown> {
  run_id: string;
  task: string;
  version: number;
  status: RunStatus;
  /** The parsed JSON value when the task has an output schema, else the text. */
  output?: Output;
  error?: string;
  model?: string;
  /** Model calls made so far. */
  attempts: number;
  tokens: { prompt: number; completion: number };
  cost_usd?: number;
  cached?: boolean;
  /** Why a queued run is not running. */
  waiting_for?: "budget" | "provider" | "batch";
}

/** The `202` of `POST /v1/tasks/{name}/runs`. */
export interface RunAccepted {
  run_id: string;
  status: "queued";
}

/** `GET /v1/summaries/{job_id}`, and a `POST /v1/summaries` that finished within its wait. */
export interface SummaryJob {
  job_id: string;
  status: "queued" | "done" | "failed" | "cancelled";
  summary?: string;
  error?: string;
  attempts?: number;
  /** Prompt and completion tokens together. */
  tokens?: number;
  /** What those calls were charged, when the model has a price. */
  cost_usd?: number;
  /** True when the summary was reused from an earlier identical job (the result cache). */
  cached?: boolean;
}

/** The `202` of `POST /v1/summaries`. */
export interface SummaryAccepted {
  job_id: string;
  status: "queued";
}

/** The webhook a finished summary job sends. */
export interface SummaryReadyEvent {
  type: "summary.ready";
  job_id: string;
  status: "done";
  summary: string;
}

/** The webhook a finished run sends. */
export interface RunEvent<Output = unknown> {
  type: "run.completed" | "run.failed" | "run.expired";
  run_id: string;
  task: string;
  version: number;
  status: RunStatus;
  output?: Output;
  error?: string;
}

/** Any webhook Oncely sends. */
export type WebhookEvent = SummaryReadyEvent | RunEvent;

/** Calls, tokens, cost and cache hits of some of a tenant's runs (`GET /v1/usage`). */
export interface UsageFigures {
  calls: number;
  failures: number;
  tokens: { prompt: number; completion: number };
  /** Null when none of the calls had a price. */
  cost_usd: number | null;
  unpriced_calls: number;
  /** Of the calls, those made through a provider batch, at the model's batch prices. */
  batch_calls: number;
  cache_hits: number;
  /** What the cache hits would have cost. */
  saved: { tokens: { prompt: number; completion: number }; cost_usd: number | null };
}

/** One of the tenant's budgets, with what is spent and held by calls in flight. */
export interface BudgetView {
  period: "day" | "month";
  unit: "usd" | "tokens";
  limit: number;
  spent: number;
  reserved: number;
  /** When the period ends (ISO 8601, UTC). */
  resets_at: string;
}

/** `GET /v1/usage`: the calling tenant's own figures. */
export interface Usage {
  since: string;
  from: string;
  totals: UsageFigures;
  by_task: (UsageFigures & { task: string; version: number })[];
  by_model: (UsageFigures & { model: string })[];
  budgets: BudgetView[];
}
