/**
 * The checks of a task definition beyond its shape, which compile its
 * schemas: what `PUT /v1/tasks/{name}` runs on a Web Worker
 * (`definition_worker.ts`), so that this module imports nothing but the
 * schema compiler. Templates substitute `{{input.path}}` with that input
 * value and nothing else; a placeholder must name a property the input
 * schema allows.
 */
import { type CompiledSchema, compileSchema, resolvePointer, SchemaRefused } from "./json_schema.ts";
import { MAX_OUTPUT_TOKENS } from "../llm/llm.ts";
import { smallestInstanceChars } from "../llm/schema_instance.ts";

/** What the checks read of a definition (`TaskDefinition` in `definition.ts`, once its shape is checked). */
export interface CheckableDefinition {
  prompt: string;
  system?: string;
  input_schema: Record<string, unknown>;
  output_schema?: boolean | Record<string, unknown>;
  max_output_tokens?: number;
}

/** A problem with a definition beyond its shape: `pointer` says where in the body. */
export class DefinitionRefused extends Error {
  constructor(readonly pointer: string, message: string) {
    super(message);
    this.name = "DefinitionRefused";
  }
}

/** A checked definition, with its schemas compiled. */
export interface CheckedTask<D extends CheckableDefinition = CheckableDefinition> {
  definition: D;
  input: CompiledSchema;
  output?: CompiledSchema;
}

/**
 * Checks a parsed definition: its schemas compile (the input schema describes an object) and every
 * placeholder of its templates names a property the input schema allows.
 * @throws {DefinitionRefused} naming the place in the body and the reason.
 */
export function checkDefinition<D extends CheckableDefinition>(definition: D): CheckedTask<D> {
  const input = compileAt("/input_schema", definition.input_schema);
  if (definition.input_schema.type !== "object") {
    throw new DefinitionRefused("/input_schema/type", 'input_schema must describe an object ("type": "object")');
  }
  const output = definition.output_schema === undefined
    ? undefined
    : compileAt("/output_schema", definition.output_schema);
  if (definition.output_schema !== undefined) {
    checkStrict(definition.output_schema, "/output_schema", true);
    // A model's answer is at most its output cap (about 4 characters a token): a schema whose smallest instance is
    // longer can never be answered, and building that instance must not hold the worker's thread either.
    const tokens = definition.max_output_tokens ?? MAX_OUTPUT_TOKENS;
    const chars = tokens * 4;
    if (smallestInstanceChars(definition.output_schema, { maxChars: chars, maxNodes: chars }) === Infinity) {
      throw new DefinitionRefused(
        "/output_schema",
        `the smallest answer this output schema allows does not fit max_output_tokens (${tokens} tokens, about ` +
          `${chars} characters): raise max_output_tokens or lower the schema's minItems and minLength`,
      );
    }
  }
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

/** A placeholder: `{{input.a.b}}`, spaces allowed inside the braces. */
export const PLACEHOLDER = /\{\{\s*input((?:\.[A-Za-z0-9_$-]+)+)\s*\}\}/g;

/** The input paths a template's placeholders name, each as its property names. */
export function placeholders(template: string): string[][] {
  return [...template.matchAll(PLACEHOLDER)].map((m) => m[1]!.slice(1).split("."));
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
