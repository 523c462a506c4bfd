/**
 * Turns Redis's flat `[k, v, k, v]` reply (a stream entry's fields, or an
 * `XINFO` record, whose values may be numbers) into an object.
 */
export function fieldsToObject<T = string>(flat: readonly T[]): Record<string, T> {
  const out: Record<string, T> = {};
  for (let i = 0; i + 1 < flat.length; i += 2) out[String(flat[i])] = flat[i + 1]!;
  return out;
}
