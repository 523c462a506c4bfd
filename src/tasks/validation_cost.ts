/**
 * What a validation will cost, estimated before it runs: in the caller's
 * thread, whether it is small enough to run there; on a validation Worker,
 * whether it is small enough to run at all. In Deno 2.9.6 a busy Worker does
 * not stop when it is terminated, so the bound on a Worker's validation is
 * this estimate, not the deadline.
 *
 * One unit is a subschema evaluated on one value, one keyword or array entry
 * or key of either, or 64 characters of a string. A regular expression run on
 * RE2 (`linear_regex.ts`) costs per character in proportion to its size:
 * `1 + size / 12` units, which covers the worst runs found on re2js 2.10.0 (a
 * DFA that keeps starting again). What a unit and those runs took, measured,
 * is in the README, "Every validation is bounded in time".
 */
import { type CompiledSchema, linearFormatSize, resolvePointer } from "./json_schema.ts";

/*
 * What `@cfworker/json-schema` 4.1.6 (dist/esm/validate.js) does per
 * evaluation of one subschema on one value: every keyword costs O(1) or the
 * size of the keyword's value (enum, const, required) or of the value's own
 * entries (Object.keys, one encodePointer per key), except `pattern` and
 * `patternProperties` (a regular expression per string or key), `uniqueItems`
 * (every item against every other), and the formats below. Evaluations
 * multiply through the applicators, which the estimate follows.
 */

/** Formats of `@cfworker/json-schema` whose V8 regular expression or parse is not known to be linear. */
const UNBOUNDED_FORMATS = new Set(["uri", "uri-reference", "uri-template", "regex"]);

/** Keywords whose value is data, never a subschema that is evaluated. */
const DATA = new Set(["enum", "const", "default", "examples"]);

/** Keywords whose value maps names (data) to subschemas. */
const SCHEMA_MAPS = new Set(["$defs", "definitions", "properties", "patternProperties", "dependentSchemas"]);

/** Keywords with one subschema, evaluated on the value itself. */
const IN_PLACE = ["not", "if", "then", "else"];
/** Keywords with a list of subschemas, each evaluated on the value itself. */
const IN_PLACE_LISTS = ["allOf", "anyOf", "oneOf"];
/** Keywords with a map of subschemas, each evaluated on the value itself (an object). */
const IN_PLACE_MAPS = ["dependentSchemas", "dependencies"];
/** Keywords with one subschema, evaluated on every property value of an object. */
const EVERY_PROPERTY = ["additionalProperties", "unevaluatedProperties"];
/** Keywords with one subschema, evaluated on every item of an array. */
const EVERY_ITEM = ["additionalItems", "contains", "unevaluatedItems"];

const CHARS_PER_UNIT = 64;

/**
 * Units per key of an object per `patternProperties` expression, besides running it: the validator builds a
 * location per key there, which costs about what four units do (measured in the README, "Every validation is
 * bounded in time", the fifth probe).
 */
const PATTERN_KEY_UNITS = 4;

/**
 * Units per character of a string checked against `format: "regex"`: V8 parses it as an expression, each
 * `\p{...}` eagerly (see README, "Every validation is bounded in time", the sixth probe), once per distinct
 * string. The format refuses strings longer than a pattern may be (1,000 characters) without parsing them.
 */
const REGEX_FORMAT_UNITS = 128;

/**
 * The formats V8 checks with expressions linear in the string but slower than a unit per 64 characters (the
 * seventh probe of issue 37 found 64 characters a unit an underestimate; measured in the README, "Every
 * validation is bounded in time"). Counted at 12 characters a unit.
 */
const URI_FORMATS = new Set(["uri", "uri-reference", "uri-template"]);
const URI_CHARS_PER_UNIT = 12;
const REGEX_FORMAT_MAX_CHARS = 1_000;

/**
 * How long a key or pattern is once the validator has written it into a location (a JSON pointer, URI-encoded):
 * a letter, digit or `-._` stays one character; `~` and `/` become two, other ASCII up to three, and every
 * other character up to nine (its UTF-8 bytes, each `%XX`).
 */
function encodedLength(text: string): number {
  let length = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    const plain = (c >= 97 && c <= 122) || (c >= 65 && c <= 90) || (c >= 48 && c <= 57) || c === 45 || c === 46 ||
      c === 95;
    length += plain ? 1 : c < 128 ? 3 : 9;
  }
  return length;
}

/** Units of one run of an RE2 expression of `size` on a text of `length` characters. */
function regexUnits(size: number, length: number): number {
  return 2 + Math.ceil(length * (1 + size / 12));
}

/** A compiled schema with what its validations' estimates need. */
export interface CostedSchema {
  /** The schema as compiled (its subschemas are the keys below). */
  schema: unknown;
  compiled: CompiledSchema;
  /**
   * Whether the estimate bounds every keyword of it: none whose cost it does not know (`uniqueItems` is
   * estimated, but its quadratic worst case is not for the caller's thread).
   */
  linear: boolean;
  weights: WeakMap<object, number>;
  /** Per subschema, the sizes of the RE2 expressions it runs on a string (`pattern`, `format: "url"`). */
  stringRegexes: WeakMap<object, number[]>;
  /**
   * Per subschema, its `patternProperties` expressions, run on every key of an object: each one's size, and the
   * units the validator spends per key besides (it writes the pattern, URI-encoded, into a location per key).
   */
  keyRegexes: WeakMap<object, { size: number; perKey: number }[]>;
  /**
   * Per subschema, the objects and arrays among its `enum` values and `const`: comparing an object value with
   * each costs the value's own entries (the validator lists both sides' keys first).
   */
  enumObjects: WeakMap<object, number>;
  /**
   * Per subschema, the names its `required` and `dependentRequired` list: each one missing is an error, which
   * every enclosing evaluation copies into its own list on the way out.
   */
  requiredNames: WeakMap<object, number>;
  /** The subschemas with `format: "regex"`: V8 parses the string as an expression (`REGEX_FORMAT_UNITS`). */
  regexFormats: WeakSet<object>;
  /** The subschemas with a `uri` format: V8's expressions for them cost more a character (`URI_CHARS_PER_UNIT`). */
  uriFormats: WeakSet<object>;
  /** Its weight: every subschema's, added up. */
  total: number;
  /**
   * Whether it has no `$ref` and no regular expression: each subschema then applies at most once to each part
   * of a value at the cost of its weight, so the weight times the value's size bounds the work.
   */
  tree: boolean;
}

/**
 * Walks every object of a schema's JSON (but data keywords' values): whether it holds no keyword whose one
 * evaluation the estimate cannot bound, each object's weight (one, plus one per keyword, plus the size of its
 * data keywords' values), and the regular expressions each runs.
 *
 * An `id` keyword (draft 4's `$id`, which the validator still follows) moves the base of references away
 * from what {@linkcode resolvePointer} resolves, so the estimate would follow other subschemas than the
 * validator does: such a schema is never `linear`.
 */
export function costed(schema: unknown, compiled: CompiledSchema): CostedSchema {
  const weights = new WeakMap<object, number>();
  const stringRegexes = new WeakMap<object, number[]>();
  const keyRegexes = new WeakMap<object, { size: number; perKey: number }[]>();
  const enumObjects = new WeakMap<object, number>();
  const requiredNames = new WeakMap<object, number>();
  const regexFormats = new WeakSet<object>();
  const uriFormats = new WeakSet<object>();
  const sizeOf = (source: string) => compiled.patterns.get(source)?.size ?? 0;
  let linear = true;
  let total = 0;
  let tree = true;
  const visit = (node: unknown): void => {
    if (typeof node !== "object" || node === null) return;
    if (Array.isArray(node)) return node.forEach(visit);
    let weight = 1;
    const strings: number[] = [];
    for (const [key, value] of Object.entries(node)) {
      weight += 1;
      if (key === "pattern" && typeof value === "string") strings.push(sizeOf(value));
      if (key === "format" && typeof value === "string") {
        const size = linearFormatSize(value);
        if (size !== undefined) strings.push(size);
        if (UNBOUNDED_FORMATS.has(value)) linear = false;
        if (value === "regex") regexFormats.add(node);
        if (URI_FORMATS.has(value)) uriFormats.add(node);
      }
      if (key === "required" && Array.isArray(value)) {
        requiredNames.set(node, (requiredNames.get(node) ?? 0) + value.length);
      }
      if (key === "dependentRequired" && typeof value === "object" && value !== null) {
        const names = Object.values(value).reduce((n: number, list) => n + (Array.isArray(list) ? list.length : 0), 0);
        requiredNames.set(node, (requiredNames.get(node) ?? 0) + names);
      }
      if (key === "patternProperties" && typeof value === "object" && value !== null) {
        keyRegexes.set(
          node,
          Object.keys(value).map((source) => ({
            size: sizeOf(source),
            perKey: PATTERN_KEY_UNITS + Math.floor(encodedLength(source) / CHARS_PER_UNIT),
          })),
        );
      }
      const objects = (key === "enum" && Array.isArray(value) ? value : key === "const" ? [value] : [])
        .filter((item) => typeof item === "object" && item !== null).length;
      if (objects > 0) enumObjects.set(node, (enumObjects.get(node) ?? 0) + objects);
      if ((key === "uniqueItems" && value === true) || (key === "id" && typeof value === "string" && value !== "")) {
        linear = false;
      }
      if (key === "$ref" || key === "$dynamicRef") tree = false;
      if (SCHEMA_MAPS.has(key) && typeof value === "object" && value !== null && !Array.isArray(value)) {
        // A map of names to subschemas: a name is data (a property may be called "default" or "pattern"),
        // its subschema is not.
        for (const [name, sub] of Object.entries(value)) {
          weight += 1 + Math.floor(name.length / CHARS_PER_UNIT);
          visit(sub);
        }
      } else if (DATA.has(key) || key === "required" || key === "dependentRequired") weight += jsonSize(value);
      else visit(value);
    }
    if (strings.length > 0) stringRegexes.set(node, strings);
    if (strings.length > 0 || keyRegexes.has(node)) tree = false;
    weights.set(node, weight);
    total += weight;
  };
  visit(schema);
  return {
    schema,
    compiled,
    linear,
    weights,
    stringRegexes,
    keyRegexes,
    enumObjects,
    requiredNames,
    regexFormats,
    uriFormats,
    total,
    tree,
  };
}

/**
 * Values, keys and array entries in a JSON value, a string or key counting one more per 64 characters. The
 * validator writes a failing `const` or `enum` value into its message (`Instance does not match ...`, a
 * `JSON.stringify` of it), and `contains`, `anyOf` and their kind keep every failing branch's messages until they
 * finish: counted as one unit, a 60 KB `const` in `contains` over 100,000 items was estimated far below its
 * cost and took an API to its heap limit (the fourth probe of issue 37; see README, "Every validation is bounded
 * in time"). By its length, the work and the memory are both bounded by the estimate: at most 64 characters of
 * message a unit.
 */
function jsonSize(value: unknown): number {
  if (typeof value === "string") return 1 + Math.floor(value.length / CHARS_PER_UNIT);
  if (typeof value !== "object" || value === null) return 1;
  let size = 1;
  for (const [key, item] of Object.entries(value)) {
    size += 1 + Math.floor(key.length / CHARS_PER_UNIT) + jsonSize(item);
  }
  return size;
}

/** Thrown inside {@linkcode estimate} to stop the walk. */
const OVER_BUDGET = Symbol("over budget");

/**
 * The estimated cost of validating `instance`, in units, or Infinity past `budget`: walks the subschemas the
 * validator would evaluate on each value, as it does (but every branch, even where the validator may stop
 * early), adding each evaluation's cost, and stops as soon as the sum exceeds `budget`. So it runs in
 * O(budget) whatever the schema and instance, and a validation under budget takes about as long.
 */
export function estimate(entry: CostedSchema, instance: unknown, budget: number): number {
  const { schema: root, weights, stringRegexes, keyRegexes, enumObjects, requiredNames, regexFormats, uriFormats } =
    entry;
  const entries = new WeakMap<object, number>();
  const sizes = new WeakMap<object, number>();
  let units = 0;
  const spend = (n: number) => {
    units += n;
    if (units > budget) throw OVER_BUDGET;
  };
  /** A value's own cost per evaluation: its entries (keys and their pointers) or its characters. */
  const ownCost = (value: unknown): number => {
    if (typeof value === "string") return 1 + Math.floor(value.length / CHARS_PER_UNIT);
    if (typeof value !== "object" || value === null) return 1;
    let cost = entries.get(value);
    if (cost === undefined) {
      cost = 1;
      if (Array.isArray(value)) cost += value.length;
      else for (const key in value) cost += 1 + Math.floor(key.length / CHARS_PER_UNIT);
      entries.set(value, cost);
    }
    return cost;
  };
  /** A value's whole size (what comparing it with another can cost), spent as it is measured. */
  const wholeCost = (value: unknown): number => {
    if (typeof value !== "object" || value === null) return ownCost(value);
    let size = sizes.get(value);
    if (size === undefined) {
      size = ownCost(value);
      spend(size);
      for (const item of Object.values(value)) size += wholeCost(item);
      sizes.set(value, size);
    }
    return size;
  };
  /** A key's length in a location (`encodedLength`), kept per key for long keys. */
  const keyLengths = new Map<string, number>();
  const keyLength = (key: string): number => {
    if (key.length <= 16) return encodedLength(key);
    let length = keyLengths.get(key);
    if (length === undefined) keyLengths.set(key, length = encodedLength(key));
    return length;
  };
  /**
   * One evaluation of `schema` on `value`, at a location `at` characters long: the validator writes each
   * evaluation's location, and keeps it with each error (the whole path of keys to the value: a 600,000-
   * character key times 10,000 failing items ran an API out of memory where counting the key once estimated it
   * small; see README, "Every validation is bounded in time", the fifth probe).
   */
  const evaluate = (schema: unknown, value: unknown, at: number, frames: number): void => {
    const located = Math.floor(at / CHARS_PER_UNIT);
    // `false` fails every value, and writes its location into the error.
    if (typeof schema !== "object" || schema === null) return spend(1 + located);
    spend((weights.get(schema) ?? jsonSize(schema)) + ownCost(value) + located);
    const s = schema as Record<string, unknown>;
    const inner = frames + 1;
    if (typeof s.$ref === "string") evaluate(resolvePointer(root, s.$ref), value, at, inner);
    for (const k of IN_PLACE) if (k in s) evaluate(s[k], value, at, inner);
    for (const k of IN_PLACE_LISTS) {
      if (Array.isArray(s[k])) {
        for (const sub of s[k] as unknown[]) evaluate(sub, value, at, inner);
      }
    }
    const objects = enumObjects.get(schema);
    if (objects !== undefined && typeof value === "object" && value !== null) spend(objects * ownCost(value));
    // Each missing name is an error, copied by every enclosing evaluation (about 8 ns a copy: 1/64 of a unit).
    const names = requiredNames.get(schema);
    if (names !== undefined && typeof value === "object" && value !== null) {
      spend(Math.floor(names * frames / CHARS_PER_UNIT));
    }
    if (typeof value === "string") {
      for (const size of stringRegexes.get(schema) ?? []) spend(regexUnits(size, value.length));
      if (regexFormats.has(schema) && value.length <= REGEX_FORMAT_MAX_CHARS) {
        spend(value.length * REGEX_FORMAT_UNITS);
      }
      if (uriFormats.has(schema)) spend(Math.floor(value.length / URI_CHARS_PER_UNIT));
      return;
    }
    if (typeof value !== "object" || value === null) return;
    if (Array.isArray(value)) {
      // Every item against every other: at most the number of items times the whole array.
      if (s.uniqueItems === true) spend(value.length * wholeCost(value));
      // An index's digits and its slash.
      const item = (i: number) => at + 2 + Math.floor(Math.log10(i + 1));
      for (const k of ["prefixItems", "items"]) {
        if (Array.isArray(s[k])) {
          (s[k] as unknown[]).forEach((sub, i) => i < value.length && evaluate(sub, value[i], item(i), inner));
        }
      }
      for (const k of ["items", ...EVERY_ITEM]) {
        if (k in s && !Array.isArray(s[k])) value.forEach((v, i) => evaluate(s[k], v, item(i), inner));
      }
      return;
    }
    const object = value as Record<string, unknown>;
    const under = (key: string) => at + 1 + keyLength(key);
    for (const { size, perKey } of keyRegexes.get(schema) ?? []) {
      for (const key in object) spend(regexUnits(size, key.length) + perKey + Math.floor(under(key) / CHARS_PER_UNIT));
    }
    for (const k of IN_PLACE_MAPS) {
      const map = s[k];
      if (typeof map !== "object" || map === null) continue;
      for (const sub of Object.values(map)) if (!Array.isArray(sub)) evaluate(sub, value, at, inner);
    }
    if (typeof s.properties === "object" && s.properties !== null) {
      for (const [key, sub] of Object.entries(s.properties)) {
        if (Object.hasOwn(object, key)) evaluate(sub, object[key], under(key), inner);
      }
    }
    if (typeof s.patternProperties === "object" && s.patternProperties !== null) {
      // Every subschema on every value: an upper bound of what the keys that match make it evaluate.
      for (const sub of Object.values(s.patternProperties)) {
        for (const key in object) evaluate(sub, object[key], under(key), inner);
      }
    }
    for (const k of EVERY_PROPERTY) {
      if (k in s) { for (const key in object) evaluate(s[k], object[key], under(key), inner); }
    }
    if ("propertyNames" in s) { for (const key in object) evaluate(s.propertyNames, key, under(key), inner); }
  };
  try {
    evaluate(root, instance, 0, 1);
    return units;
  } catch (error) {
    if (error === OVER_BUDGET) return Infinity;
    // A walk deeper than the stack (a long chain of references at every level): too costly to run here, and on
    // a Worker the validator's own recursion would overflow as well.
    if (error instanceof RangeError) return Infinity;
    throw error;
  }
}
