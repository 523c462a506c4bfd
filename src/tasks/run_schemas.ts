import { z } from "zod";

/** Body of `GET /v1/runs/{run_id}` (and of `DELETE`). */
export const RunDocument = z.object({
  run_id: z.uuid(),
  task: z.string(),
  version: z.number().int().min(1),
  status: z.enum(["queued", "done", "failed", "cancelled"]),
  output: z.unknown().optional().describe("The parsed JSON when the task has an output schema, else the text"),
  error: z.string().optional(),
  attempts: z.number().int().describe("Model calls made for this run so far (recorded within a second)"),
  tokens: z.object({ prompt: z.number().int(), completion: z.number().int() }),
});
export type RunDocument = z.infer<typeof RunDocument>;
