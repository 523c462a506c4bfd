/**
 * A task definition: a tenant's prompt, model and schemas, checked before
 * it is stored. Templates substitute `{{input.path}}` with that input value
 * and nothing else; a placeholder must name a property the input schema
 * allows.
 */
import { z } from "zod";
import { MAX_OUTPUT_TOKENS, SUMMARY_INSTRUCTION } from "../llm/llm.ts";
import { storableText } from "../summaries/schemas.ts";
import { type CompiledSchema, compileSchema, SchemaRefused } from "./json_schema.ts";

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
  cache_ttl_s: z.number().int().min(0).max(365 * 24 * 3600).optional(),
});
export type TaskDefinition = z.infer<typeof TaskDefinition>;

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
  for (const field of ["prompt", "system"] as const) {
    const template = definition[field];
    if (template === undefined) continue;
    for (const path of placeholders(template)) {
      if (!allows(definition.input_schema, path, definition.input_schema, 0)) {
        throw new DefinitionRefused(
          `/${field}`,
          `{{input.${path.join(".")}}} names no property the input schema declares`,
        );
      }
    }
  }
  return { definition, input, output };
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

/**
 * The template with each `{{input.path}}` replaced by that input value: a string as it is, anything else as
 * JSON, and an absent value as nothing. No other text is read as a placeholder.
 */
export function renderTemplate(template: string, input: unknown): string {
  return template.replace(PLACEHOLDER, (_, path: string) => {
    let value: unknown = input;
    for (const key of path.slice(1).split(".")) {
      value = value !== null && typeof value === "object" ? (value as Record<string, unknown>)[key] : undefined;
    }
    if (value === undefined) return "";
    return typeof value === "string" ? value : JSON.stringify(value);
  });
}

/**
 * Whether `schema` declares a value at `path`: in `properties`, `patternProperties`, `items`, or an explicit
 * `additionalProperties` (local `$ref`s followed, a few levels deep).
 */
function allows(schema: unknown, path: string[], root: unknown, depth: number): boolean {
  if (depth > 32) return true;
  if (schema === false) return false;
  if (schema === true) return true;
  if (schema === undefined || schema === null || typeof schema !== "object") return path.length === 0;
  const s = schema as Record<string, unknown>;
  if (path.length === 0) return true;
  if (typeof s.$ref === "string" && allows(resolveRef(root, s.$ref), path, root, depth + 1)) return true;
  const [head, ...rest] = path as [string, ...string[]];
  for (const key of ["allOf", "anyOf", "oneOf"] as const) {
    if (Array.isArray(s[key]) && (s[key] as unknown[]).some((b) => allows(b, path, root, depth + 1))) return true;
  }
  const properties = s.properties as Record<string, unknown> | undefined;
  if (properties && Object.hasOwn(properties, head)) return allows(properties[head], rest, root, depth + 1);
  const patterns = s.patternProperties as Record<string, unknown> | undefined;
  for (const [pattern, sub] of Object.entries(patterns ?? {})) {
    if (new RegExp(pattern, "u").test(head)) return allows(sub, rest, root, depth + 1);
  }
  if (/^\d+$/.test(head) && (s.items !== undefined || s.prefixItems !== undefined)) {
    const prefix = Array.isArray(s.prefixItems) ? s.prefixItems : [];
    return allows(prefix[Number(head)] ?? s.items, rest, root, depth + 1);
  }
  // An undeclared name is allowed only where the schema says so (additionalProperties given): a placeholder
  // that names nothing declared is most likely a typo, which would render as nothing on every run.
  if (s.additionalProperties === undefined || s.additionalProperties === false) return false;
  return allows(s.additionalProperties, rest, root, depth + 1);
}

/** The subschema a local `$ref` (`#/a/b`) names, or undefined. */
function resolveRef(root: unknown, ref: string): unknown {
  if (!ref.startsWith("#")) return undefined;
  let node: unknown = root;
  for (const raw of ref.slice(1).split("/").slice(1)) {
    const key = decodeURIComponent(raw).replace(/~1/g, "/").replace(/~0/g, "~");
    node = node !== null && typeof node === "object" ? (node as Record<string, unknown>)[key] : undefined;
  }
  return node;
}

/** The built-in `summarize` task, as `GET /v1/tasks` shows it: what `/v1/summaries` runs. */
export const SUMMARIZE_DEFINITION: TaskDefinition = {
  prompt: `${SUMMARY_INSTRUCTION}\n\n{{input.text}}`,
  input_schema: {
    type: "object",
    properties: { text: { type: "string", minLength: 1, maxLength: 200_000 } },
    required: ["text"],
  },
  max_output_tokens: MAX_OUTPUT_TOKENS,
};
