/** Task definitions that tests and measurements PUT: small ones, and the heaviest the checks accept. */

/**
 * An object schema of `{a: string, b: integer}` objects under `field_0`, `field_1`, ..., as many as fit
 * `maxBytes` of JSON, every object strict (all properties required, no others), as output schemas must be.
 */
export function wideSchema(maxBytes = 64 * 1024 - 256): Record<string, unknown> {
  const properties: Record<string, unknown> = {};
  const required: string[] = [];
  const schema = { type: "object", properties, required, additionalProperties: false };
  for (let i = 0;; i++) {
    const name = `field_${i}`;
    properties[name] = {
      type: "object",
      properties: { a: { type: "string", maxLength: 5 }, b: { type: "integer", minimum: 0 } },
      required: ["a", "b"],
      additionalProperties: false,
    };
    required.push(name);
    if (JSON.stringify(schema).length > maxBytes) {
      delete properties[name];
      required.pop();
      return schema;
    }
  }
}

const WIDE = wideSchema();

/**
 * A definition as costly to check as the limits allow (two schemas of almost 64 KiB: 70-140 ms to compile on
 * this machine), about 190 KB of JSON with its 60,000-character prompt; `seed` makes it differ from others.
 */
export function heavyDefinition(seed: number | string = 0): Record<string, unknown> {
  return {
    prompt: `Task ${seed}: ${"x".repeat(60_000)} {{input.field_1.a}}`,
    input_schema: WIDE,
    output_schema: WIDE,
    // Its smallest answer (every field's object) must fit the output cap, or the PUT is refused.
    max_output_tokens: 16_384,
  };
}

/** A small valid definition; `seed` makes it differ from others. */
export function smallDefinition(seed: number | string = 0): Record<string, unknown> {
  return {
    prompt: `Classify ${seed}: {{input.body}}`,
    input_schema: { type: "object", properties: { body: { type: "string" } }, required: ["body"] },
    max_output_tokens: 50,
  };
}
