import { z } from "zod";

/**
 * Text Postgres can store: no NUL character and no unpaired UTF-16
 * surrogate. Either passes JSON parsing and would only fail at the commit,
 * after the model was paid for, on every delivery.
 */
const storableText = (field: string) =>
  z.string().refine((s) => !s.includes("\u0000") && s.isWellFormed(), {
    message: `${field} must not contain NUL characters or unpaired surrogates (the database cannot store them)`,
  });

/** Body of `POST /v1/summaries`. Unknown fields are rejected. */
export const SummaryRequest = z.strictObject({
  text: storableText("text").min(1).max(200_000).describe("The document to summarise, 1 to 200,000 characters"),
  notify: z.email().max(320).describe("Where to email the summary when it is ready"),
});
export type SummaryRequest = z.infer<typeof SummaryRequest>;

/** Body of the 202 response. */
export const SummaryAccepted = z.object({
  job_id: z.uuid(),
  status: z.literal("queued"),
});

/** Body of `GET /v1/summaries/{job_id}`. */
export const SummaryStatus = z.object({
  job_id: z.uuid(),
  status: z.enum(["queued", "done", "failed"]),
  summary: z.string().optional(),
  error: z.string().optional(),
});
export type SummaryStatus = z.infer<typeof SummaryStatus>;

/** `Idempotency-Key`: 16 to 128 visible ASCII characters. */
export const IdempotencyKey = z.string().regex(/^[\x21-\x7e]{16,128}$/);
