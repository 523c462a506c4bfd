/**
 * A task definition: a tenant's prompt, model and schemas, checked before
 * it is stored (its shape here, the rest in `definition_check.ts`).
 * Templates substitute `{{input.path}}` with that input value and nothing
 * else; a placeholder must name a property the input schema allows.
 */
import { z } from "zod";
import { MAX_OUTPUT_TOKENS, SUMMARY_INSTRUCTION } from "../llm/llm.ts";
import { storableText } from "../db/storable_text.ts";
import { PLACEHOLDER } from "./definition_check.ts";

export { checkDefinition, type CheckedTask, DefinitionRefused, placeholders } from "./definition_check.ts";

/** A task's name: `[a-z][a-z0-9_-]{0,63}`. */
export const TASK_NAME = /^[a-z][a-z0-9_-]{0,63}$/;

/** The task every tenant has, which `/v1/summaries` runs; nobody can PUT it. */
export const BUILT_IN_TASK = "summarize";

const MODEL = z.string().min(1).max(200).regex(/^[\x21-\x7e]+$/, "a model name is visible ASCII characters");
const SCHEMA = z.union([z.boolean(), z.record(z.string(), z.unknown())]);

/** Body of `PUT /v1/tasks/{name}`. Unknown fields are rejected. */
export const TaskDefinition = z.strictObject({
  prompt: storableText("prompt").min(1).max(100_000).describe(
    "The user message; {{input.path}} is replaced by that input value (a string as it is, anything else as JSON)",
  ),
  system: storableText("system").max(100_000).optional().describe("The system message, a template as prompt is"),
  model: z.union([MODEL, z.array(MODEL).min(1).max(8)]).optional().describe(
    "A model, or models in order of preference (runs use the first for now), each one a deployment serves; " +
      "unset, the default model (OPENAI_MODEL when a deployment serves it)",
  ),
  input_schema: z.record(z.string(), z.unknown()).describe(
    "JSON Schema 2020-12 of the input: an object, at most 64 KiB",
  ),
  output_schema: SCHEMA.optional().describe("JSON Schema 2020-12 of the output (structured output); unset, text"),
  max_output_tokens: z.number().int().min(1).max(16_384).default(MAX_OUTPUT_TOKENS),
  temperature: z.number().min(0).max(2).optional(),
  cache_ttl_s: z.number().int().min(0).optional(),
});
export type TaskDefinition = z.infer<typeof TaskDefinition>;

/**
 * The most a version's definition may take, in UTF-8 bytes of compact JSON with its schemas and the defaults
 * filled in (what the store measures): each field is bounded (two templates of 100,000 characters, two schemas
 * of 64 KiB), and together they could come to about 730 KB.
 */
export const DEFINITION_LIMITS = { maxBytes: 256 * 1024 } as const;

/** A task version as the API answers it: its definition with its name, version and creation time. */
export const TaskDocument = TaskDefinition.extend({
  name: z.string(),
  version: z.number().int().min(1),
  created_at: z.iso.datetime().optional().describe("When this version was stored (absent for the built-in task)"),
  built_in: z.boolean().optional().describe("true for summarize, which every tenant has"),
});

/** A task in `GET /v1/tasks`: its latest version's number, time and size, without the definition. */
export const TaskListItem = z.object({
  name: z.string(),
  version: z.number().int().min(1).describe("The latest version"),
  created_at: z.iso.datetime().optional().describe("When the latest version was stored (absent for summarize)"),
  bytes: z.number().int().describe("The latest version's definition: UTF-8 bytes of compact JSON"),
  versions: z.number().int().min(1).describe("How many versions the task has"),
  total_bytes: z.number().int().describe("Every version's definition, in bytes, added up"),
  built_in: z.boolean().optional().describe("true for summarize, which every tenant has"),
});

/** The body of `GET /v1/tasks`: one page of the tenant's tasks, and what they hold against its limits. */
export const TaskList = z.object({
  tasks: z.array(TaskListItem).describe("By name; the first page starts with summarize"),
  next: z.string().nullable().describe("The next page's path (`/v1/tasks?after=...&limit=...`); null on the last"),
  usage: z.object({
    tasks: z.number().int(),
    max_tasks: z.number().int(),
    bytes: z.number().int().describe("Every version of every task, in bytes of compact JSON"),
    max_bytes: z.number().int(),
  }).describe("The tenant's tasks and their bytes against what it may store"),
});

/** An input value as a placeholder renders it: a string as it is, anything else as JSON, nothing when absent. */
function renderedValue(input: unknown, path: readonly string[]): string {
  const value = valueAt(input, path);
  if (value === undefined) return "";
  return typeof value === "string" ? value : String(JSON.stringify(value));
}

/** The value a placeholder's path names in `input`; undefined when there is none. */
function valueAt(input: unknown, path: readonly string[]): unknown {
  let value: unknown = input;
  for (const key of path) {
    value = value !== null && typeof value === "object" && Object.hasOwn(value, key)
      ? (value as Record<string, unknown>)[key]
      : undefined;
  }
  return value;
}

/**
 * `renderedValue(...).length` without rendering: a string's length, else the length of its JSON, from the
 * lengths of its parts, each object's kept in `lengths`. So placeholders that name an object and the objects
 * inside it (`{{input.a}}{{input.a.a}}`...) cost one walk of the input in all, where stringifying each cost the
 * input's size per placeholder (what that held the API's thread is in the README, "Running a task").
 */
function renderedValueLength(value: unknown, lengths: WeakMap<object, number>): number {
  if (value === undefined) return 0;
  return typeof value === "string" ? value.length : jsonLength(value, lengths);
}

/** The length of `JSON.stringify(value)` for a value parsed from JSON, objects' lengths kept in `lengths`. */
function jsonLength(value: unknown, lengths: WeakMap<object, number>): number {
  if (typeof value === "string") return JSON.stringify(value).length;
  if (typeof value !== "object" || value === null) return String(value).length;
  const known = lengths.get(value);
  if (known !== undefined) return known;
  let length: number;
  if (Array.isArray(value)) {
    // "[" and "]", and a comma between items.
    length = 2 + Math.max(0, value.length - 1);
    for (const item of value) length += jsonLength(item, lengths);
  } else {
    const keys = Object.keys(value);
    // "{" and "}", a colon after each key, and a comma between entries.
    length = 2 + keys.length + Math.max(0, keys.length - 1);
    for (const key of keys) {
      length += JSON.stringify(key).length + jsonLength((value as Record<string, unknown>)[key], lengths);
    }
  }
  lengths.set(value, length);
  return length;
}

/** A template read once: its text without placeholders, and each placeholder's path, distinct, with its count. */
interface ParsedTemplate {
  fixed: number;
  paths: { path: string[]; count: number }[];
}

/**
 * Templates read so far (a task version's on its first run), up to 2,000,000 characters of them in all: past
 * that, they are all read again as they come (a template is at most 100,000).
 */
const parsedTemplates = new Map<string, ParsedTemplate>();
const PARSED_TEMPLATE_CHARS = 2_000_000;
let parsedChars = 0;

function parsedTemplate(template: string): ParsedTemplate {
  let parsed = parsedTemplates.get(template);
  if (!parsed) {
    const byPath = new Map<string, { path: string[]; count: number }>();
    let fixed = template.length;
    for (const match of template.matchAll(PLACEHOLDER)) {
      fixed -= match[0].length;
      const found = byPath.get(match[1]!);
      if (found) found.count++;
      else byPath.set(match[1]!, { path: match[1]!.slice(1).split("."), count: 1 });
    }
    parsed = { fixed, paths: [...byPath.values()] };
    if (parsedChars + template.length > PARSED_TEMPLATE_CHARS) {
      parsedTemplates.clear();
      parsedChars = 0;
    }
    parsedTemplates.set(template, parsed);
    parsedChars += template.length;
  }
  return parsed;
}

/**
 * The template with each `{{input.path}}` replaced by that input value: a string as it is, anything else as
 * JSON, and an absent value as nothing. No other text is read as a placeholder.
 */
export function renderTemplate(template: string, input: unknown): string {
  return template.replace(PLACEHOLDER, (_, path: string) => renderedValue(input, path.slice(1).split(".")));
}

/** The most characters a run's prompt and system message may come to once rendered, together. */
export const RENDER_LIMITS = { maxChars: 400_000 };

/**
 * How long `template` is once rendered with `input`, without rendering it: each value's length is measured
 * once per placeholder path, so a template that names a large value many times costs one measurement.
 */
export function renderedLength(
  template: string,
  input: unknown,
  lengths: WeakMap<object, number> = new WeakMap(),
): number {
  const { fixed, paths } = parsedTemplate(template);
  let length = fixed;
  for (const { path, count } of paths) length += count * renderedValueLength(valueAt(input, path), lengths);
  return length;
}

/** The rendered length of a definition's prompt and system message together (see {@linkcode RENDER_LIMITS}). */
export function renderedChars(definition: Pick<TaskDefinition, "prompt" | "system">, input: unknown): number {
  const lengths = new WeakMap<object, number>();
  return renderedLength(definition.prompt, input, lengths) +
    (definition.system === undefined ? 0 : renderedLength(definition.system, input, lengths));
}

/**
 * The built-in `summarize` task, as `GET /v1/tasks` shows it: what `/v1/summaries` runs. It stays version 1
 * whatever a release changes in it; the result cache keys runs by a digest of this definition too
 * (`definitionDigest` in `src/cache/result_cache.ts`), so a release that changes it misses the old entries.
 */
export const SUMMARIZE_DEFINITION: TaskDefinition = {
  prompt: `${SUMMARY_INSTRUCTION}\n\n{{input.text}}`,
  input_schema: {
    type: "object",
    properties: { text: { type: "string", minLength: 1, maxLength: 200_000 } },
    required: ["text"],
  },
  max_output_tokens: MAX_OUTPUT_TOKENS,
};
