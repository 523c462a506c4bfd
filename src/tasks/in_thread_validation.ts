/** Validation in this thread, compiled once per key: the stand-in until validations are bounded in time. */
import { type CompiledSchema, compileSchema, type SchemaViolation } from "./json_schema.ts";

export function inThreadValidation(): (key: string, schema: unknown, instance: unknown) => Promise<SchemaViolation[]> {
  const compiled = new Map<string, CompiledSchema>();
  return (key, schema, instance) => {
    let c = compiled.get(key);
    if (!c) {
      if (compiled.size >= 500) compiled.delete(compiled.keys().next().value!);
      compiled.set(key, c = compileSchema(schema));
    }
    return Promise.resolve(c.validate(instance));
  };
}
