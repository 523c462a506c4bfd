/**
 * A value valid against a strict structured-output schema (what task output
 * schemas are): the fake model's answer to a `json_schema` request. Covers
 * the keywords strict schemas use: type, properties/required, items, enum,
 * const, anyOf, $ref to `#/...`, and the numeric and length bounds.
 */
export function instanceOf(schema: unknown, root: unknown = schema, depth = 0): unknown {
  if (schema === true || schema === undefined || depth > 32) return {};
  if (typeof schema !== "object" || schema === null) return null;
  const s = schema as Record<string, unknown>;
  if (typeof s.$ref === "string") {
    const target = s.$ref.slice(2).split("/").filter(Boolean).reduce<unknown>(
      (node, key) => (node as Record<string, unknown>)?.[key.replace(/~1/g, "/").replace(/~0/g, "~")],
      root,
    );
    return instanceOf(target, root, depth + 1);
  }
  if ("const" in s) return s.const;
  if (Array.isArray(s.enum)) return s.enum[0];
  if (Array.isArray(s.anyOf)) return instanceOf(s.anyOf[0], root, depth + 1);
  const type = Array.isArray(s.type) ? s.type.find((t) => t !== "null") ?? "null" : s.type;
  switch (type) {
    case "object": {
      const properties = (s.properties ?? {}) as Record<string, unknown>;
      return Object.fromEntries(Object.entries(properties).map(([k, v]) => [k, instanceOf(v, root, depth + 1)]));
    }
    case "array": {
      const n = typeof s.minItems === "number" ? s.minItems : 1;
      return Array.from({ length: n }, () => instanceOf(s.items, root, depth + 1));
    }
    case "string": {
      const n = typeof s.minLength === "number" ? s.minLength : 1;
      return "x".repeat(Math.max(1, n));
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
