/**
 * Tenants' JSON Schemas, treated as untrusted: each is at most 64 KiB, must
 * be a valid JSON Schema 2020-12 (checked against the official meta-schemas),
 * may refer only to itself (no `$ref` to another document, so nothing is
 * fetched), and may use only regular expressions that cannot backtrack
 * catastrophically. A schema that passes is compiled once into a validator
 * (`@cfworker/json-schema`: an interpreter, so a schema is data and never
 * code), cached by the caller per task version.
 */
import { type OutputUnit, Validator } from "@cfworker/json-schema";
import ret, { type Tokens, types } from "ret";
import safeRegex from "safe-regex2";
import applicator from "./metaschema/applicator.json" with { type: "json" };
import content from "./metaschema/content.json" with { type: "json" };
import core from "./metaschema/core.json" with { type: "json" };
import formatAnnotation from "./metaschema/format-annotation.json" with { type: "json" };
import metaData from "./metaschema/meta-data.json" with { type: "json" };
import metaSchema from "./metaschema/schema.json" with { type: "json" };
import unevaluated from "./metaschema/unevaluated.json" with { type: "json" };
import validation from "./metaschema/validation.json" with { type: "json" };

/** Limits on a tenant's schema. */
export const SCHEMA_LIMITS = {
  /** Its JSON, in bytes. */
  maxBytes: 64 * 1024,
  /** One regular expression (`pattern`, a `patternProperties` key), in characters. */
  maxPatternLength: 1_000,
  /** Repetitions (`*`, `+`, `{n,m}`) in one regular expression: bounds the degree of its backtracking. */
  maxRepetitions: 10,
  /** Nesting of objects and arrays in a schema's JSON. */
  maxDepth: 64,
  /**
   * Subschemas that one value of an instance can make a validation evaluate in place (through `$ref`,
   * `allOf`, `anyOf`, `oneOf`, `not`, `if`/`then`/`else`, `dependentSchemas`), counted along every path.
   */
  maxInPlace: 1_000,
} as const;

/** Why a tenant's schema was refused: `pointer` says where in the schema. */
export class SchemaRefused extends Error {
  constructor(readonly pointer: string, reason: string) {
    super(`${pointer || "the schema"}: ${reason}`);
    this.name = "SchemaRefused";
  }
}

/** A validation failure: the first failing place in the instance, and why. */
export interface SchemaViolation {
  /** A JSON pointer into the instance ("" is the whole of it). */
  pointer: string;
  message: string;
}

/** A compiled schema. */
export interface CompiledSchema {
  /** @returns the violations, the first (deepest) first; none when `instance` is valid. */
  validate(instance: unknown): SchemaViolation[];
}

/** ret's tokenizer: its CommonJS export is the function itself, which its type declarations do not say. */
const parseRegex = ret as unknown as (pattern: string) => Tokens;

let metaValidator: Validator | undefined;

/** The 2020-12 meta-schema with its vocabularies, compiled once. */
function meta(): Validator {
  if (metaValidator) return metaValidator;
  const v = new Validator(metaSchema as never, "2020-12", true);
  for (const vocabulary of [core, applicator, unevaluated, validation, metaData, formatAnnotation, content]) {
    v.addSchema(vocabulary as never);
  }
  return metaValidator = v;
}

/**
 * Checks a tenant's schema and compiles it.
 * @throws {SchemaRefused} naming the place and the reason when it is too large, not a JSON Schema 2020-12,
 * refers to another document, or holds a regular expression that is invalid or could backtrack without bound.
 */
export function compileSchema(schema: unknown): CompiledSchema {
  const bytes = new TextEncoder().encode(JSON.stringify(schema) ?? "").length;
  if (bytes > SCHEMA_LIMITS.maxBytes) {
    throw new SchemaRefused("", `is ${bytes} bytes of JSON; the limit is ${SCHEMA_LIMITS.maxBytes}`);
  }
  if (typeof schema !== "boolean" && (typeof schema !== "object" || schema === null || Array.isArray(schema))) {
    throw new SchemaRefused("", "must be an object or a boolean");
  }
  // The JSON itself first (before anything recursive runs on it): depth, storable text, finite numbers.
  checkJson(schema, "", undefined, 0);
  const checked = meta().validate(schema);
  if (!checked.valid) {
    const first = deepest(checked.errors);
    throw new SchemaRefused(
      first.instanceLocation.replace(/^#/, ""),
      `is not valid JSON Schema 2020-12: ${first.error}`,
    );
  }
  walk(schema, "");
  countInPlace(schema);
  let validator: Validator;
  try {
    validator = new Validator(schema as never, "2020-12", true);
  } catch (error) {
    throw new SchemaRefused("", `cannot be compiled: ${error instanceof Error ? error.message : String(error)}`);
  }
  return {
    validate(instance) {
      const result = validator.validate(instance);
      if (result.valid) return [];
      const first = deepest(result.errors);
      return [{ pointer: jsonPointer(first.instanceLocation), message: first.error }];
    },
  };
}

/** The error deepest in the instance: the one that names the failing value, not its parents. */
function deepest(errors: OutputUnit[]): OutputUnit {
  const depth = (unit: OutputUnit) => unit.instanceLocation.split("/").length;
  return errors.reduce((a, b) => (depth(b) > depth(a) ? b : a));
}

/**
 * The validator's instance location (`#/a%20b/c~1d`: a URI fragment, percent-encoded) as the JSON pointer it
 * names (`/a b/c~1d`): what a 422 and a failed run's reason show.
 */
function jsonPointer(location: string): string {
  return location.replace(/^#/, "").split("/").map((segment) => {
    try {
      return decodeURIComponent(segment);
    } catch {
      return segment;
    }
  }).join("/");
}

/** Keywords whose value is a map of subschemas, and those whose value is a subschema or a list of them. */
const SCHEMA_MAPS = new Set(["$defs", "definitions", "properties", "patternProperties", "dependentSchemas"]);

/** Keywords this service does not follow (dynamic scope, anchors): a schema using them is refused. */
const UNSUPPORTED = new Set(["$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "$anchor"]);

/**
 * The schema's JSON as data: at most `maxDepth` deep, every string and key storable in Postgres (no NUL, no
 * unpaired surrogate), every number finite (JSON's 1e400 parses to Infinity and would be stored as null).
 */
function checkJson(node: unknown, parent: string, key: string | undefined, depth: number): number {
  // The pointer is built only where it is needed (a refusal, or the parent of an object's entries).
  const pointer = () => (key === undefined ? parent : `${parent}/${escapePointer(key)}`);
  if (typeof node === "string") {
    if (node.includes("\u0000") || !node.isWellFormed()) {
      throw new SchemaRefused(pointer(), "a string with a NUL character or an unpaired surrogate");
    }
    return 1 + (node.length >> 6);
  }
  if (typeof node === "number") {
    if (!Number.isFinite(node)) throw new SchemaRefused(pointer(), "a number too large to store");
    return 1;
  }
  if (typeof node !== "object" || node === null) return 1;
  if (depth >= SCHEMA_LIMITS.maxDepth) {
    throw new SchemaRefused(pointer(), `nested more than ${SCHEMA_LIMITS.maxDepth} levels deep`);
  }
  const here = pointer();
  let units = 1;
  if (Array.isArray(node)) {
    for (let i = 0; i < node.length; i++) units += checkJson(node[i], here, String(i), depth + 1);
    return units;
  }
  for (const name in node) {
    if (!Object.hasOwn(node, name)) continue;
    units += checkJson(name, here, name, depth + 1) +
      checkJson((node as Record<string, unknown>)[name], here, name, depth + 1);
  }
  return units;
}

/**
 * Walks every subschema: references are JSON pointers into this schema that resolve (`#`, `#/$defs/x`), no
 * keyword of dynamic scope or anchors, `$id` only at the root, and every regular expression is safe.
 */
function walk(node: unknown, pointer: string, root: unknown = node): void {
  if (Array.isArray(node)) {
    node.forEach((item, i) => walk(item, `${pointer}/${i}`, root));
    return;
  }
  if (typeof node !== "object" || node === null) return;
  for (const [key, value] of Object.entries(node)) {
    const at = `${pointer}/${escapePointer(key)}`;
    if (UNSUPPORTED.has(key)) throw new SchemaRefused(at, `${key} is not supported: use $ref with a JSON pointer`);
    if (key === "$id" && pointer !== "") throw new SchemaRefused(at, "$id is allowed only at the root");
    // Older drafts' keywords that the validator still follows but 2020-12 replaced: `id` would move where
    // references point, and `dependencies` would apply subschemas that the in-place count does not see.
    if (key === "id" && typeof value === "string") {
      throw new SchemaRefused(at, "id is not a JSON Schema 2020-12 keyword (use $id, at the root)");
    }
    if (key === "dependencies") {
      throw new SchemaRefused(at, "dependencies is not a JSON Schema 2020-12 keyword (use dependentSchemas)");
    }
    if (key === "$ref") {
      if (typeof value !== "string" || !(value === "#" || value.startsWith("#/"))) {
        throw new SchemaRefused(at, "may refer only to this schema, by a JSON pointer (# or #/...)");
      }
      if (resolvePointer(root, value) === undefined) {
        throw new SchemaRefused(at, `${value} names nothing in the schema`);
      }
    }
    if (key === "pattern" && typeof value === "string") checkPattern(value, at);
    if (key === "patternProperties" && typeof value === "object" && value !== null) {
      for (const p of Object.keys(value)) checkPattern(p, `${at}/${escapePointer(p)}`);
    }
    if (key === "enum" || key === "const" || key === "examples" || key === "default") continue;
    if (SCHEMA_MAPS.has(key) && typeof value === "object" && value !== null) {
      for (const [name, sub] of Object.entries(value)) walk(sub, `${at}/${escapePointer(name)}`, root);
    } else {
      walk(value, at, root);
    }
  }
}

/** The value a local reference (`#` or `#/a/b`) names in `root`, or undefined. */
export function resolvePointer(root: unknown, ref: string): unknown {
  let node: unknown = root;
  for (const raw of ref.slice(1).split("/").slice(1)) {
    let key: string;
    try {
      key = decodeURIComponent(raw).replace(/~1/g, "/").replace(/~0/g, "~");
    } catch {
      return undefined;
    }
    if (node === null || typeof node !== "object" || !Object.hasOwn(node, key)) return undefined;
    node = (node as Record<string, unknown>)[key];
  }
  return node;
}

/** Keywords that evaluate a subschema on the same value (not on a part of it). */
const IN_PLACE_ONE = ["not", "if", "then", "else"];
const IN_PLACE_MANY = ["allOf", "anyOf", "oneOf"];

/**
 * Counts, for the root, the subschemas one value can make a validation evaluate in place, along every path
 * (an `anyOf` of five `$ref`s to an `anyOf` of five... multiplies), and refuses a cycle of in-place
 * references (`{"$ref": "#"}` at the root: a validation would never end) or a count over `maxInPlace`.
 * Each subschema that applies to a part of the value starts a count of its own.
 */
function countInPlace(root: unknown): void {
  const counts = new Map<unknown, number>();
  const visiting = new Set<unknown>();
  const count = (node: unknown, pointer: string): number => {
    if (typeof node !== "object" || node === null || Array.isArray(node)) return 1;
    const known = counts.get(node);
    if (known !== undefined) return known;
    if (visiting.has(node)) {
      throw new SchemaRefused(pointer, "a cycle of references that never goes into a part of the value");
    }
    visiting.add(node);
    const s = node as Record<string, unknown>;
    let total = 1;
    const add = (sub: unknown, at: string) => {
      total += count(sub, at);
      if (total > SCHEMA_LIMITS.maxInPlace) {
        throw new SchemaRefused(at, `makes one value evaluate more than ${SCHEMA_LIMITS.maxInPlace} subschemas`);
      }
    };
    if (typeof s.$ref === "string") {
      const target = resolvePointer(root, s.$ref);
      if (visiting.has(target)) {
        throw new SchemaRefused(`${pointer}/$ref`, "a cycle of references that never goes into a part of the value");
      }
      add(target, s.$ref.slice(1));
    }
    for (const k of IN_PLACE_ONE) if (k in s) add(s[k], `${pointer}/${k}`);
    for (const k of IN_PLACE_MANY) {
      if (Array.isArray(s[k])) (s[k] as unknown[]).forEach((sub, i) => add(sub, `${pointer}/${k}/${i}`));
    }
    if (s.dependentSchemas && typeof s.dependentSchemas === "object") {
      for (const [name, sub] of Object.entries(s.dependentSchemas)) {
        add(sub, `${pointer}/dependentSchemas/${escapePointer(name)}`);
      }
    }
    visiting.delete(node);
    counts.set(node, total);
    return total;
  };
  // Every subschema, wherever it applies (the root, a property's, an item's...), starts a count of its own.
  const every = (node: unknown, pointer: string): void => {
    if (typeof node !== "object" || node === null) return;
    if (!Array.isArray(node)) count(node, pointer);
    for (const [key, value] of Object.entries(node)) {
      if (key === "enum" || key === "const" || key === "examples" || key === "default") continue;
      every(value, `${pointer}/${escapePointer(key)}`);
    }
  };
  every(root, "");
}

/**
 * A regular expression a validation may run on any string a tenant sends: it must compile as JSON Schema
 * says (ECMA-262, unicode), and must not be able to backtrack without bound: no back-references or
 * look-arounds, no repetition inside a repetition, no repetition of a choice (`(a|a)*`), and at most
 * `maxRepetitions` repetitions.
 */
function checkPattern(pattern: string, pointer: string): void {
  if (pattern.length > SCHEMA_LIMITS.maxPatternLength) {
    throw new SchemaRefused(pointer, `a pattern of at most ${SCHEMA_LIMITS.maxPatternLength} characters`);
  }
  try {
    new RegExp(pattern, "u");
  } catch (error) {
    throw new SchemaRefused(pointer, `not a valid regular expression: ${(error as Error).message}`);
  }
  let tokens: Tokens;
  try {
    tokens = parseRegex(pattern);
  } catch (error) {
    throw new SchemaRefused(pointer, `not a regular expression this service can check: ${(error as Error).message}`);
  }
  const unsafe = unboundedBacktracking(tokens, false);
  if (unsafe || !safeRegex(pattern, { limit: SCHEMA_LIMITS.maxRepetitions })) {
    throw new SchemaRefused(
      pointer,
      `a pattern that could take unbounded time on some inputs${unsafe ? ` (${unsafe})` : ""}: ` +
        "no nested repetition, no repeated alternation, no back-references or look-arounds, " +
        `at most ${SCHEMA_LIMITS.maxRepetitions} repetitions`,
    );
  }
}

/** What makes a regular expression's tokens unsafe (see {@linkcode checkPattern}), or null. */
function unboundedBacktracking(token: Tokens, repeated: boolean): string | null {
  switch (token.type) {
    case types.REFERENCE:
      return "a back-reference";
    case types.REPETITION:
      return unboundedBacktracking(token.value, true);
    case types.ROOT:
    case types.GROUP: {
      if (token.type === types.GROUP && (token.followedBy || token.notFollowedBy || token.lookBehind)) {
        return "a look-around";
      }
      if (token.options && repeated) return "a repeated alternation";
      for (const branch of token.options ?? [token.stack ?? []]) {
        for (const t of branch) {
          const found = unboundedBacktracking(t, repeated);
          if (found) return found;
        }
      }
      return null;
    }
    default:
      return null;
  }
}

function escapePointer(key: string): string {
  return key.replace(/~/g, "~0").replace(/\//g, "~1");
}

/**
 * Where a value (a run's input) holds what Postgres's jsonb cannot store or what is nested too deep: the
 * pointer and the reason; else its size in the validators' units (a value, a key, 64 characters of a string:
 * see `validator.ts`), for a validation's bound.
 */
export function unstorableJson(value: unknown): { pointer: string; message: string } | { units: number } {
  try {
    return { units: checkJson(value, "", undefined, 0) };
  } catch (error) {
    if (!(error instanceof SchemaRefused)) throw error;
    return { pointer: error.pointer, message: error.message };
  }
}
