/**
 * A task definition: a tenant's prompt, model and schemas, checked before
 * it is stored. Templates substitute `{{input.path}}` with that input value
 * and nothing else; a placeholder must name a property the input schema
 * allows.
 */
import { z } from "zod";
import { MAX_OUTPUT_TOKENS, SUMMARY_INSTRUCTION } from "../llm/llm.ts";
import { storableText } from "../summaries/schemas.ts";
import { type CompiledSchema, compileSchema, resolvePointer, SchemaRefused } from "./json_schema.ts";

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
    "A model, or models in order of preference (runs use the first for now); unset, the deployment's OPENAI_MODEL",
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

/** A task version as the API answers it: its definition with its name, version and creation time. */
export const TaskDocument = TaskDefinition.extend({
  name: z.string(),
  version: z.number().int().min(1),
  created_at: z.iso.datetime().optional().describe("When this version was stored (absent for the built-in task)"),
  built_in: z.boolean().optional().describe("true for summarize, which every tenant has"),
});

/** A problem with a definition beyond its shape: `pointer` says where in the body. */
export class DefinitionRefused extends Error {
  constructor(readonly pointer: string, message: string) {
    super(message);
    this.name = "DefinitionRefused";
  }
}

/** A checked definition, with its schemas compiled. */
export interface CheckedTask {
  definition: TaskDefinition;
  input: CompiledSchema;
  output?: CompiledSchema;
}

/**
 * Checks a parsed definition: its schemas compile (the input schema describes an object) and every
 * placeholder of its templates names a property the input schema allows.
 * @throws {DefinitionRefused} naming the place in the body and the reason.
 */
export function checkDefinition(definition: TaskDefinition): CheckedTask {
  const input = compileAt("/input_schema", definition.input_schema);
  if (definition.input_schema.type !== "object") {
    throw new DefinitionRefused("/input_schema/type", 'input_schema must describe an object ("type": "object")');
  }
  const output = definition.output_schema === undefined
    ? undefined
    : compileAt("/output_schema", definition.output_schema);
  if (definition.output_schema !== undefined) checkStrict(definition.output_schema, "/output_schema", true);
  const budget = { steps: PLACEHOLDER_CHECK_STEPS };
  for (const field of ["prompt", "system"] as const) {
    const template = definition[field];
    if (template === undefined) continue;
    for (const path of placeholders(template)) {
      if (!declares(definition.input_schema, path, definition.input_schema, budget)) {
        throw new DefinitionRefused(
          `/${field}`,
          `{{input.${path.join(".")}}} names no property the input schema declares`,
        );
      }
    }
  }
  return { definition, input, output };
}

/**
 * The rules of the provider's strict structured outputs, which runs ask for: the root is an object, and every
 * object lists all its properties in `required` and says `"additionalProperties": false`. A schema that breaks
 * them would fail every run at the provider, so it is refused here.
 */
function checkStrict(schema: unknown, pointer: string, root: boolean): void {
  if (typeof schema !== "object" || schema === null) {
    if (root) throw new DefinitionRefused(pointer, 'output_schema must be an object schema ("type": "object")');
    return;
  }
  if (Array.isArray(schema)) {
    schema.forEach((sub, i) => checkStrict(sub, `${pointer}/${i}`, false));
    return;
  }
  const s = schema as Record<string, unknown>;
  if (root && s.type !== "object") {
    throw new DefinitionRefused(`${pointer}/type`, 'output_schema must describe an object ("type": "object")');
  }
  if (s.type === "object" || s.properties !== undefined) {
    const names = Object.keys((s.properties ?? {}) as object);
    const required = Array.isArray(s.required) ? s.required : [];
    const missing = names.find((n) => !required.includes(n));
    if (s.additionalProperties !== false || missing !== undefined) {
      throw new DefinitionRefused(
        pointer || "/",
        "structured outputs need every object to list all its properties in required and to say " +
          `"additionalProperties": false${
            missing === undefined ? "" : ` (${JSON.stringify(missing)} is not required)`
          }`,
      );
    }
  }
  for (const [key, value] of Object.entries(s)) {
    if (key === "enum" || key === "const" || key === "examples" || key === "default") continue;
    if (value !== null && typeof value === "object") checkStrict(value, `${pointer}/${key}`, false);
  }
}

function compileAt(at: string, schema: unknown): CompiledSchema {
  try {
    return compileSchema(schema);
  } catch (error) {
    if (error instanceof SchemaRefused) {
      throw new DefinitionRefused(
        `${at}${error.pointer}`,
        `${at.slice(1)}${error.pointer}: ${error.message.replace(/^[^:]*: /, "")}`,
      );
    }
    throw error;
  }
}

const PLACEHOLDER = /\{\{\s*input((?:\.[A-Za-z0-9_$-]+)+)\s*\}\}/g;

/** The input paths a template's placeholders name, each as its property names. */
export function placeholders(template: string): string[][] {
  return [...template.matchAll(PLACEHOLDER)].map((m) => m[1]!.slice(1).split("."));
}

/** An input value as a placeholder renders it: a string as it is, anything else as JSON, nothing when absent. */
function renderedValue(input: unknown, path: readonly string[]): string {
  let value: unknown = input;
  for (const key of path) {
    value = value !== null && typeof value === "object" && Object.hasOwn(value, key)
      ? (value as Record<string, unknown>)[key]
      : undefined;
  }
  if (value === undefined) return "";
  return typeof value === "string" ? value : String(JSON.stringify(value));
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
export function renderedLength(template: string, input: unknown): number {
  const { fixed, paths } = parsedTemplate(template);
  let length = fixed;
  for (const { path, count } of paths) length += count * renderedValue(input, path).length;
  return length;
}

/** The rendered length of a definition's prompt and system message together (see {@linkcode RENDER_LIMITS}). */
export function renderedChars(definition: Pick<TaskDefinition, "prompt" | "system">, input: unknown): number {
  return renderedLength(definition.prompt, input) +
    (definition.system === undefined ? 0 : renderedLength(definition.system, input));
}

/** Steps {@linkcode declares} may take for one definition; the schema's in-place count bounds it anyway. */
const PLACEHOLDER_CHECK_STEPS = 10_000;

/**
 * Whether `schema` declares a value at `path`: in `properties`, `items`/`prefixItems`, or under an explicit
 * `additionalProperties`, also through `$ref`, `allOf`, `anyOf` and `oneOf`. `patternProperties` do not
 * count: checking a name against a tenant's pattern would run it, and the name is the tenant's too.
 * @throws {DefinitionRefused} when the check would take more than its steps.
 */
function declares(schema: unknown, path: string[], root: unknown, budget: { steps: number }): boolean {
  if (--budget.steps < 0) {
    throw new DefinitionRefused("/input_schema", "the input schema is too complex to check the placeholders against");
  }
  if (schema === false) return false;
  if (schema === true) return true;
  if (schema === undefined || schema === null || typeof schema !== "object") return path.length === 0;
  if (path.length === 0) return true;
  const s = schema as Record<string, unknown>;
  if (typeof s.$ref === "string" && declares(resolvePointer(root, s.$ref), path, root, budget)) return true;
  for (const key of ["allOf", "anyOf", "oneOf"] as const) {
    if (Array.isArray(s[key]) && (s[key] as unknown[]).some((b) => declares(b, path, root, budget))) return true;
  }
  const [head, ...rest] = path as [string, ...string[]];
  const properties = s.properties as Record<string, unknown> | undefined;
  if (properties && Object.hasOwn(properties, head)) return declares(properties[head], rest, root, budget);
  if (/^\d+$/.test(head) && (s.items !== undefined || s.prefixItems !== undefined)) {
    const prefix = Array.isArray(s.prefixItems) ? s.prefixItems : [];
    return declares(prefix[Number(head)] ?? s.items, rest, root, budget);
  }
  // An undeclared name is allowed only where the schema says so (additionalProperties given): a placeholder
  // that names nothing declared is most likely a typo, which would render as nothing on every run.
  if (s.additionalProperties === undefined || s.additionalProperties === false) return false;
  return declares(s.additionalProperties, rest, root, budget);
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
