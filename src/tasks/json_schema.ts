/**
 * Tenants' JSON Schemas, treated as untrusted: each is at most 64 KiB, must
 * be a valid JSON Schema 2020-12 (checked against the official meta-schemas),
 * may refer only to itself (no `$ref` to another document, so nothing is
 * fetched), and its regular expressions run on RE2's linear-time engine
 * (`linear_regex.ts`), never on V8's backtracking one. A schema that passes is
 * compiled once into a validator (`@cfworker/json-schema`: an interpreter, so a
 * schema is data and never code), cached by the caller per task version.
 */
import { format, type OutputUnit, Validator } from "@cfworker/json-schema";
import { compileLinearRegex, type LinearRegex, REGEX_LIMITS, RegexRefused } from "./linear_regex.ts";
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
  /** Distinct regular expressions in one schema: each is compiled and keeps a DFA of its own. */
  maxPatterns: 32,
  /**
   * Their sizes as RE2 compiles them (`LinearRegex.size`), added up: with `maxPatterns`, bounds the time to
   * compile them all, which the API's thread spends at a version's first run there (measured in the README,
   * "Tenant regular expressions cannot run long").
   */
  maxPatternsSize: 2_500,
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
  constructor(readonly pointer: string, readonly reason: string, options?: ErrorOptions) {
    super(`${pointer || "the schema"}: ${reason}`, options);
    this.name = "SchemaRefused";
  }
}

/** A validation whose walk went deeper than the stack (a long chain of references at every level). */
export class ValidationTooDeep extends Error {
  constructor(options?: ErrorOptions) {
    super("Schema validation of this value goes deeper than the validator can", options);
    this.name = "ValidationTooDeep";
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
  /** Its regular expressions by source, compiled for RE2 (what a validation's cost estimate reads their sizes from). */
  readonly patterns: ReadonlyMap<string, LinearRegex>;
  /** About the memory it holds, in bytes: its JSON's size times 8, and each expression's program and DFA. */
  readonly weight: number;
}

/** How {@linkcode compileSchema} treats a schema. */
export interface CompileOptions {
  /**
   * The schema was accepted when it was stored, perhaps by an earlier release: its regular expressions need only
   * compile for RE2, not pass the rules for new ones (their shape and size, how many there are: `linear_regex.ts`
   * and `SCHEMA_LIMITS`), which RE2 does not need. Every other check still applies.
   */
  stored?: boolean;
}

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
 * refers to another document, or holds a regular expression that is invalid, that RE2 cannot express, or (unless
 * `stored`) whose shape could backtrack.
 */
export function compileSchema(schema: unknown, { stored = false }: CompileOptions = {}): CompiledSchema {
  const bytes = new TextEncoder().encode(JSON.stringify(schema) ?? "").length;
  if (bytes > SCHEMA_LIMITS.maxBytes) {
    throw new SchemaRefused("", `is ${bytes} bytes of JSON; the limit is ${SCHEMA_LIMITS.maxBytes}`);
  }
  if (typeof schema !== "boolean" && (typeof schema !== "object" || schema === null || Array.isArray(schema))) {
    throw new SchemaRefused("", "must be an object or a boolean");
  }
  // The JSON itself first (before anything recursive runs on it): depth, storable text, finite numbers.
  checkJson(schema, "", undefined, 0);
  metaChecking = true;
  let checked;
  try {
    checked = meta().validate(schema);
  } finally {
    metaChecking = false;
  }
  if (!checked.valid) {
    const first = deepest(checked.errors);
    throw new SchemaRefused(
      first.instanceLocation.replace(/^#/, ""),
      `is not valid JSON Schema 2020-12: ${first.error}`,
    );
  }
  const found = new Map<string, string>();
  walk(schema, "", schema, found);
  const patterns = compilePatterns(found, stored);
  countInPlace(schema);
  let validator: Validator;
  try {
    validator = new Validator(schema as never, "2020-12", true);
  } catch (error) {
    throw new SchemaRefused("", `cannot be compiled: ${error instanceof Error ? error.message : String(error)}`);
  }
  let weight = bytes * 8;
  for (const pattern of patterns.values()) weight += pattern.size * 64 + REGEX_LIMITS.dfaBytes;
  return {
    patterns,
    weight,
    validate(instance) {
      let result;
      try {
        result = withLinearRegExp(patterns, () => validator.validate(instance));
      } catch (error) {
        // The validator recurses per subschema and per value: a walk deeper than the stack is too deep to run.
        if (error instanceof RangeError) throw new ValidationTooDeep({ cause: error });
        throw error;
      }
      if (result.valid) return [];
      const first = deepest(result.errors);
      return [{ pointer: jsonPointer(first.instanceLocation), message: first.error }];
    },
  };
}

/** The schema's regular expressions (source: where it first is) checked and compiled for RE2. */
function compilePatterns(found: Map<string, string>, stored: boolean): Map<string, LinearRegex> {
  if (!stored && found.size > SCHEMA_LIMITS.maxPatterns) {
    const [, pointer] = [...found][SCHEMA_LIMITS.maxPatterns]!;
    throw new SchemaRefused(
      pointer,
      `more than ${SCHEMA_LIMITS.maxPatterns} distinct regular expressions in one schema`,
    );
  }
  const patterns = new Map<string, LinearRegex>();
  let size = 0;
  for (const [source, pointer] of found) {
    if (source.length > SCHEMA_LIMITS.maxPatternLength) {
      throw new SchemaRefused(pointer, `a pattern of at most ${SCHEMA_LIMITS.maxPatternLength} characters`);
    }
    let compiled: LinearRegex;
    try {
      compiled = compileLinearRegex(source, { strict: !stored });
    } catch (error) {
      if (error instanceof RegexRefused) throw new SchemaRefused(pointer, error.message, { cause: error });
      throw error;
    }
    size += compiled.size;
    if (!stored && size > SCHEMA_LIMITS.maxPatternsSize) {
      throw new SchemaRefused(
        pointer,
        `regular expressions of more than ${SCHEMA_LIMITS.maxPatternsSize} in size (as RE2 compiles them) in one schema`,
      );
    }
    patterns.set(source, compiled);
  }
  return patterns;
}

/** `RegExp` as the validator module knew it, before any validation. */
const NativeRegExp = RegExp;

/** The longest value of the short formats below: an RFC 3339 date-time with nanoseconds and an offset is 35. */
const SHORT_FORMAT_CHARS = 64;

/*
 * Formats of `@cfworker/json-schema` 4.1.6 (dist/esm/format.js) run V8 regular expressions on the tenant's
 * string. Searched with every repetition of one or two characters of their alphabets after each likely prefix,
 * `uri`, `uri-reference`, `uri-template`, `email`, `hostname` and `date-time` stayed fast; `url` backtracks
 * exponentially (`(?:[a-z\u{00a1}-\u{ffff}0-9]+-?)*` before each label: "http://", letters and a "_"; and its
 * `\S+(?::\S*)?@` is quadratic). The times are in the README, "Tenant regular expressions cannot run long".
 * So `url` runs on RE2 here, with the same meaning: its look-aheads, which only exclude private IPv4 addresses
 * (10/8, 127/8, 169.254/16, 192.168/16, 172.16/12), written out as the addresses it accepts. `regex` compiles the
 * tenant's string to see whether it is one, which runs nothing, but must do so with V8's own `RegExp`, not with
 * the stand-in of a validation in progress.
 */

/** An IPv4 octet as `url` reads it (`1?\d{1,2}|2[0-4]\d|25[0-5]`), and the last one. */
const OCTET = String.raw`(?:\d{1,2}|1\d\d|2[0-4]\d|25[0-5])`;
const LAST_OCTET = String.raw`(?:[1-9]\d?|1\d\d|2[0-4]\d|25[0-4])`;
/** First octets `url` accepts whatever follows: 1-223 but 10 and 127, and but the three the second octet decides. */
const PLAIN_FIRST = String
  .raw`(?:[1-9]|1[1-9]|[2-9]\d|1[01]\d|12[0-689]|1[3-5]\d|16[0-8]|17[013-9]|18\d|19[013-9]|2[01]\d|22[0-3])`;
const PUBLIC_IPV4 = String.raw`(?:${PLAIN_FIRST}\.${OCTET}` +
  String.raw`|169\.(?:\d{1,2}|1\d\d|2[0-4]\d|25[0-35])` +
  String.raw`|192\.(?:\d{1,2}|1[0-57-9]\d|16[0-79]|2[0-4]\d|25[0-5])` +
  String.raw`|172\.(?:\d|0\d|1[0-5]|3[2-9]|[4-9]\d|1\d\d|2[0-4]\d|25[0-5]))\.${OCTET}\.${LAST_OCTET}`;
/** A host character under `url`'s `iu` flags: [a-z] matches A-Z too (U+017F and U+212A are in the range). */
const HOST = String.raw`[a-zA-Z\u{00a1}-\u{ffff}0-9]`;
const LABEL = String.raw`(?:(?:${HOST}+-?)*${HOST}+)`;
const URL_FORMAT = compileLinearRegex(
  String.raw`^(?:[hH][tT][tT][pP][sS\u{017f}]?|[fF][tT][pP]):\/\/(?:\S+(?::\S*)?@)?` +
    String.raw`(?:${PUBLIC_IPV4}|${LABEL}(?:\.${LABEL})*\.[a-zA-Z\u{00a1}-\u{ffff}]{2,})(?::\d{2,5})?(?:\/[^\s]*)?$`,
  { strict: false },
);
format.url = (text) => URL_FORMAT.test(text);
const Z_ANCHOR = /[^\\]\\Z/;
/**
 * While a schema is checked against the meta-schemas, whose `format: "regex"` names every `pattern`: V8 parses
 * each `\p{...}` eagerly, so a 64 KiB pattern took long to check before its length was (see README, "Every
 * validation is bounded in time", the sixth probe); `compilePatterns` checks each pattern right after, its length
 * and count first.
 */
let metaChecking = false;
format.regex = (text) => {
  if (metaChecking) return true;
  // No pattern a schema may hold is longer: a longer string is not one, and V8 need not parse it.
  if (text.length > SCHEMA_LIMITS.maxPatternLength || Z_ANCHOR.test(text)) return false;
  try {
    new NativeRegExp(text, "u");
    return true;
  } catch {
    return false;
  }
};
/**
 * Formats whose valid values are short, but whose checks walk the whole string (`date-time` splits it on
 * `/t|\s/i` first; see README, "Every validation is bounded in time", the sixth probe): a longer string fails at
 * once.
 */
for (const name of ["date-time", "date", "time", "duration", "uuid", "ipv4", "ipv6"] as const) {
  const check = format[name]!;
  format[name] = (text) => text.length <= SHORT_FORMAT_CHARS && check(text);
}

/**
 * The size (as RE2 compiles it) of the regular expression a format runs on RE2, for a validation's cost
 * estimate; undefined for the other formats.
 */
export function linearFormatSize(name: string): number | undefined {
  return name === "url" ? URL_FORMAT.size : undefined;
}

/**
 * Runs `validate` with `RegExp` naming a stand-in that answers the schema's own regular expressions from RE2.
 * `@cfworker/json-schema` evaluates `pattern` and `patternProperties` with `new RegExp(source, "u").test(...)`
 * at each evaluation, and V8's engine can backtrack for ever on them: a Worker cannot be stopped while it does
 * (in Deno 2.9.6 `terminate()` stops no busy thread). A validation is synchronous, so nothing else runs in this
 * thread while the stand-in is in place, and it is always put back.
 */
function withLinearRegExp<T>(patterns: ReadonlyMap<string, LinearRegex>, validate: () => T): T {
  if (patterns.size === 0) return validate();
  const global = globalThis as { RegExp: unknown };
  global.RegExp = function LinearRegExp(source: string) {
    const compiled = patterns.get(source);
    // The walk found every regular expression the validator can reach; a stranger must not reach V8's engine.
    if (!compiled) throw new Error(`A regular expression this schema does not hold reached the validator: ${source}`);
    return compiled;
  };
  try {
    return validate();
  } finally {
    global.RegExp = NativeRegExp;
  }
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
 * keyword of dynamic scope or anchors, `$id` only at the root. Collects every regular expression (`pattern`,
 * `patternProperties` keys) with the first place it is at.
 */
function walk(node: unknown, pointer: string, root: unknown, patterns: Map<string, string>): void {
  if (Array.isArray(node)) {
    node.forEach((item, i) => walk(item, `${pointer}/${i}`, root, patterns));
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
    if (key === "pattern" && typeof value === "string" && !patterns.has(value)) patterns.set(value, at);
    if (key === "patternProperties" && typeof value === "object" && value !== null) {
      for (const p of Object.keys(value)) if (!patterns.has(p)) patterns.set(p, `${at}/${escapePointer(p)}`);
    }
    if (key === "enum" || key === "const" || key === "examples" || key === "default") continue;
    if (SCHEMA_MAPS.has(key) && typeof value === "object" && value !== null) {
      for (const [name, sub] of Object.entries(value)) walk(sub, `${at}/${escapePointer(name)}`, root, patterns);
    } else {
      walk(value, at, root, patterns);
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
