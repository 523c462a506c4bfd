/**
 * JSON with object keys sorted at every level, so equal values encode equally. An object's entry whose value is
 * undefined is left out, and an array's undefined element is written as nothing, as `JSON.stringify` of the
 * parts would. Written as loops: on the intake path every request's body goes through it.
 */
export function canonicalJson(value: unknown): string {
  if (value === null || typeof value !== "object") return JSON.stringify(value);
  if (Array.isArray(value)) {
    let out = "[";
    for (let i = 0; i < value.length; i++) out += (i === 0 ? "" : ",") + (canonicalJson(value[i]) ?? "");
    return `${out}]`;
  }
  const object = value as Record<string, unknown>;
  // Sorted by UTF-16 code units, as `<` compares strings.
  const keys = Object.keys(object).sort();
  let out = "{";
  for (const key of keys) {
    const entry = object[key];
    if (entry === undefined) continue;
    out += `${out.length === 1 ? "" : ","}${JSON.stringify(key)}:${canonicalJson(entry)}`;
  }
  return `${out}}`;
}
