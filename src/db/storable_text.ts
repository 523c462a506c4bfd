/**
 * Text Postgres can store: no NUL character and no unpaired UTF-16
 * surrogate. Either passes JSON parsing and would only fail at the commit,
 * after the model was paid for, on every delivery.
 */
import { z } from "zod";

/** Whether Postgres can store `s` as text. */
export const isStorable = (s: string): boolean => !s.includes("\u0000") && s.isWellFormed();

/** The refinement's error for a `field` that is not storable (see {@linkcode isStorable}). */
export const unstorable = (field: string) => ({
  message: `${field} must not contain NUL characters or unpaired surrogates (the database cannot store them)`,
});

/** A string Postgres can store (see {@linkcode isStorable}); the error names `field`. */
export const storableText = (field: string) => z.string().refine(isStorable, unstorable(field));
