/**
 * A value valid against a strict structured-output schema (what task output
 * schemas are): the embedded model's answer to a `json_schema` request, and
 * the fake model's in tests. Covers the keywords strict schemas use: type,
 * properties/required, items, enum, const, anyOf, $ref to `#/...`, and the
 * numeric and length bounds. Strings are `text` (padded to a minLength, cut
 * to a maxLength).
 */
export function instanceOf(schema: unknown, text = "x", root: unknown = schema, depth = 0): unknown {
  if (schema === true || schema === undefined || depth > 32) return {};
  if (typeof schema !== "object" || schema === null) return null;
  const s = schema as Record<string, unknown>;
  if (typeof s.$ref === "string") {
    const target = s.$ref.slice(2).split("/").filter(Boolean).reduce<unknown>(
      (node, key) => (node as Record<string, unknown>)?.[key.replace(/~1/g, "/").replace(/~0/g, "~")],
      root,
    );
    return instanceOf(target, text, root, depth + 1);
  }
  if ("const" in s) return s.const;
  if (Array.isArray(s.enum)) return s.enum[0];
  if (Array.isArray(s.anyOf)) return instanceOf(s.anyOf[0], text, root, depth + 1);
  const type = Array.isArray(s.type) ? s.type.find((t) => t !== "null") ?? "null" : s.type;
  switch (type) {
    case "object": {
      const properties = (s.properties ?? {}) as Record<string, unknown>;
      return Object.fromEntries(Object.entries(properties).map(([k, v]) => [k, instanceOf(v, text, root, depth + 1)]));
    }
    case "array": {
      const n = typeof s.minItems === "number" ? s.minItems : 1;
      return Array.from({ length: n }, () => instanceOf(s.items, text, root, depth + 1));
    }
    case "string": {
      const min = typeof s.minLength === "number" ? s.minLength : 0;
      const max = typeof s.maxLength === "number" ? s.maxLength : Infinity;
      const padded = text.length >= Math.max(1, min) ? text : text + "x".repeat(Math.max(1, min) - text.length);
      return [...padded].slice(0, max).join("");
    }
    case "integer":
    case "number":
      return typeof s.minimum === "number" ? Math.ceil(s.minimum) : 1;
    case "boolean":
      return true;
    case "null":
      return null;
    default:
      return {};
  }
}
