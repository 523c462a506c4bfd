/**
 * The summary API's own schema: its 202 answer. Its request body is also a summary job's stream payload, so
 * that schema is the run pipeline's (`SummaryRequest` in `runs/shapes.ts`).
 */
import { z } from "zod";

/** Body of the 202 answer to `POST /v1/summaries`. */
export const SummaryAccepted = z.object({
  job_id: z.uuid(),
  status: z.literal("queued"),
});
