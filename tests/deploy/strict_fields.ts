/**
 * `kubectl apply --validate=strict` for the tests: the fields of a manifest that its kind's schema does not define.
 *
 * `kubernetes-models` and `@kubernetes-models/keda` ship their schemas only as Ajv's compiled validators (no JSON
 * schema is left in the packages), and those never check for unknown properties. But a compiled validator reads
 * every property its schema defines (`data.readinessProbe`, present or not), enumerates an object only where the
 * schema maps free keys to values (`additionalProperties`: labels, annotations, resources, a trigger's metadata) and
 * leaves a free-form object (`type: object` alone, `x-kubernetes-preserve-unknown-fields`) and every leaf (strings,
 * IntOrString, Quantity) untouched. So the model's own validator is run on a proxy of the manifest that records, for
 * each path, which keys it read and whether it enumerated the object; a key of an object that was read but neither
 * enumerated nor asked for is a field the schema does not have. An object the validator never looked into is free.
 */

// deno-lint-ignore no-explicit-any
type Json = any;

interface Seen {
  read: Set<string>;
  enumerated: boolean;
}

const IDENTIFIER = /^[A-Za-z_$][\w$]*$/;
const child = (path: string, key: string | number) =>
  typeof key === "number"
    ? `${path}[${key}]`
    : IDENTIFIER.test(key)
    ? (path ? `${path}.${key}` : key)
    : `${path}[${JSON.stringify(key)}]`;

/** Runs `validate` on a recording proxy of `data`; returns what it read, per path (paths as `a.b[0].c`). */
function trace(data: Json, validate: (data: Json) => void): Map<string, Seen> {
  const seen = new Map<string, Seen>();
  const at = (path: string) => {
    let s = seen.get(path);
    if (!s) seen.set(path, s = { read: new Set(), enumerated: false });
    return s;
  };
  // Per path, not per object: a YAML alias (`matchLabels: *labels`) shares one object between several places.
  const wrap = (value: Json, path: string): Json => {
    if (value === null || typeof value !== "object") return value;
    const isArray = Array.isArray(value);
    return new Proxy(value, {
      get(target, key, receiver) {
        const v = Reflect.get(target, key, receiver);
        if (typeof key !== "string") return v;
        at(path).read.add(key);
        if (!Object.hasOwn(target, key)) return v;
        return wrap(v, isArray && /^\d+$/.test(key) ? child(path, Number(key)) : child(path, key));
      },
      has(target, key) {
        if (typeof key === "string") at(path).read.add(key);
        return Reflect.has(target, key);
      },
      ownKeys(target) {
        at(path).enumerated = true;
        return Reflect.ownKeys(target);
      },
    });
  };
  validate(wrap(data, ""));
  return seen;
}

/** The paths of the keys in `data` that the schema behind `validate` does not define. */
export function unknownFields(data: Json, validate: (data: Json) => void): string[] {
  const seen = trace(data, validate);
  const unknown: string[] = [];
  const walk = (value: Json, path: string) => {
    if (value === null || typeof value !== "object") return;
    if (Array.isArray(value)) return value.forEach((v, i) => walk(v, child(path, i)));
    const s = seen.get(path);
    if (!s || s.read.size === 0 && !s.enumerated) return; // never looked into: a free-form object
    for (const [key, v] of Object.entries(value)) {
      if (s.enumerated || s.read.has(key)) walk(v, child(path, key));
      else unknown.push(child(path, key));
    }
  };
  walk(data, "");
  return unknown;
}

/**
 * Validates `data` with a `kubernetes-models` model's own validator (type, required, format: throws as
 * `new Model(data).validate()` does) and then refuses the fields its schema does not define, as
 * `kubectl apply --validate=strict` does.
 */
export function validateStrict(Model: { prototype: { validate(): void } }, data: Json): void {
  const unknown = unknownFields(data, (proxy) => Model.prototype.validate.call(proxy));
  if (unknown.length) {
    throw new Error(
      `${data?.kind ?? "manifest"} ${data?.metadata?.name ?? ""}: unknown field ${
        unknown.map((p) => JSON.stringify(p)).join(", ")
      }`,
    );
  }
}
