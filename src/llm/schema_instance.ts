/**
 * A value valid against a strict structured-output schema (what task output
 * schemas are): the embedded model's answer to a `json_schema` request, and
 * the fake model's in tests. Covers the keywords strict schemas use: type,
 * properties/required, items, enum, const, anyOf, $ref to `#/...`, and the
 * numeric and length bounds. Strings are `text` (padded to a minLength, cut
 * to a maxLength).
 *
 * A tenant writes the schema, so building its instance is bounded: by nodes
 * (values built) and by the characters of the instance as JSON. A schema whose
 * instance passes either bound (`minItems: 300000`, or four properties that
 * each `$ref` the root: about 4^32 nodes) stops the build with
 * {@linkcode InstanceTooLarge} instead of holding the thread.
 */

/** The bounds of one instance. */
export interface InstanceBounds {
  /** The most values built (objects, arrays and scalars each count one). */
  maxNodes: number;
  /** The most characters of the instance as JSON (about `max_output_tokens` × 4 for a model's answer). */
  maxChars: number;
}

/** Bounds for callers that name none: far above any instance a model's output cap allows. */
export const DEFAULT_INSTANCE_BOUNDS: InstanceBounds = { maxNodes: 100_000, maxChars: 16_384 * 4 };

/** Raised when a schema's instance passes its bounds. */
export class InstanceTooLarge extends Error {
  constructor(readonly bound: "nodes" | "characters", readonly limit: number) {
    super(`The output schema's instance would pass ${limit.toLocaleString("en-US")} ${bound}`);
    this.name = "InstanceTooLarge";
  }
}

/** What one build has spent. */
interface Budget {
  nodes: number;
  chars: number;
  bounds: InstanceBounds;
}

function spend(budget: Budget, chars: number): void {
  budget.nodes++;
  budget.chars += chars;
  if (budget.nodes > budget.bounds.maxNodes) throw new InstanceTooLarge("nodes", budget.bounds.maxNodes);
  if (budget.chars > budget.bounds.maxChars) throw new InstanceTooLarge("characters", budget.bounds.maxChars);
}

/**
 * An instance of `schema` whose strings are `text`, within `bounds`.
 * @throws {InstanceTooLarge} when it would pass them.
 */
export function instanceOf(schema: unknown, text = "x", bounds: InstanceBounds = DEFAULT_INSTANCE_BOUNDS): unknown {
  return build(schema, text, schema, 0, { nodes: 0, chars: 0, bounds });
}

/**
 * The characters of the smallest instance this builder makes of `schema` (strings at their minLength, at least one), or
 * Infinity when it passes `bounds`: a task whose output schema cannot fit its `max_output_tokens` is refused.
 */
export function smallestInstanceChars(schema: unknown, bounds: InstanceBounds): number {
  try {
    return JSON.stringify(build(schema, "", schema, 0, { nodes: 0, chars: 0, bounds })).length;
  } catch (error) {
    if (error instanceof InstanceTooLarge) return Infinity;
    throw error;
  }
}

function build(schema: unknown, text: string, root: unknown, depth: number, budget: Budget): unknown {
  if (schema === true || schema === undefined || depth > 32) return (spend(budget, 2), {});
  if (typeof schema !== "object" || schema === null) return (spend(budget, 4), null);
  const s = schema as Record<string, unknown>;
  if (typeof s.$ref === "string") {
    const target = s.$ref.slice(2).split("/").filter(Boolean).reduce<unknown>(
      (node, key) => (node as Record<string, unknown>)?.[key.replace(/~1/g, "/").replace(/~0/g, "~")],
      root,
    );
    return build(target, text, root, depth + 1, budget);
  }
  if ("const" in s) return (spend(budget, jsonChars(s.const)), s.const);
  if (Array.isArray(s.enum)) return (spend(budget, jsonChars(s.enum[0])), s.enum[0]);
  if (Array.isArray(s.anyOf)) return build(s.anyOf[0], text, root, depth + 1, budget);
  const type = Array.isArray(s.type) ? s.type.find((t) => t !== "null") ?? "null" : s.type;
  switch (type) {
    case "object": {
      spend(budget, 2);
      const properties = (s.properties ?? {}) as Record<string, unknown>;
      const out: Record<string, unknown> = {};
      for (const [k, v] of Object.entries(properties)) {
        spend(budget, k.length + 4);
        out[k] = build(v, text, root, depth + 1, budget);
      }
      return out;
    }
    case "array": {
      spend(budget, 2);
      const n = typeof s.minItems === "number" ? s.minItems : 1;
      const out: unknown[] = [];
      for (let i = 0; i < n; i++) {
        spend(budget, 1);
        out.push(build(s.items, text, root, depth + 1, budget));
      }
      return out;
    }
    case "string": {
      const min = typeof s.minLength === "number" ? s.minLength : 0;
      const max = typeof s.maxLength === "number" ? s.maxLength : Infinity;
      // Charged before the string is made: a minLength of millions must not be allocated to be refused.
      // No string fits minLength > maxLength: nothing to build (and `minLength: 140000000, maxLength: 1` must not
      // allocate 140 million characters to be cut to one).
      if (min > max) throw new InstanceTooLarge("characters", budget.bounds.maxChars);
      const length = Math.min(Math.max(countCodePoints(text, max + 1), Math.max(1, min)), max);
      spend(budget, length + 2);
      return takeCodePoints(text, length) + "x".repeat(Math.max(0, length - countCodePoints(text, length)));
    }
    case "integer":
    case "number": {
      const value = typeof s.minimum === "number" ? Math.ceil(s.minimum) : 1;
      return (spend(budget, String(value).length), value);
    }
    case "boolean":
      return (spend(budget, 4), true);
    case "null":
      return (spend(budget, 4), null);
    default:
      return (spend(budget, 2), {});
  }
}

function jsonChars(value: unknown): number {
  return JSON.stringify(value ?? null)?.length ?? 4;
}

/** The code points of `text`, counted up to `limit` (a long text is not walked past it). */
function countCodePoints(text: string, limit: number): number {
  let n = 0;
  for (const _ of text) if (++n >= limit) break;
  return n;
}

/** The first `n` code points of `text`. */
function takeCodePoints(text: string, n: number): string {
  let out = "", taken = 0;
  for (const c of text) {
    if (taken++ >= n) break;
    out += c;
  }
  return out;
}
