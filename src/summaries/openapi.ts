import { z } from "zod";
import { IdempotencyKey, SummaryAccepted, SummaryRequest, SummaryStatus } from "./schemas.ts";

/** An RFC 9457 problem document. */
export const Problem = z.object({
  type: z.string(),
  title: z.string(),
  status: z.number().int(),
  detail: z.string(),
  errors: z.array(z.object({ path: z.string(), message: z.string() })).optional(),
});

/** The routes the API serves: the handler's router and this document both come from this list. */
export const ROUTES = [
  { method: "post", path: "/v1/summaries" },
  { method: "get", path: "/v1/summaries/{job_id}" },
  { method: "get", path: "/healthz" },
  { method: "get", path: "/readyz" },
  { method: "get", path: "/metrics" },
  { method: "get", path: "/openapi.json" },
] as const;

const schema = (s: z.ZodType) => {
  const { $schema: _, ...rest } = z.toJSONSchema(s, { io: "input", unrepresentable: "any" }) as Record<string, unknown>;
  return rest;
};

const problem = (description: string, headers?: Record<string, unknown>) => ({
  description,
  ...(headers ? { headers } : {}),
  content: { "application/problem+json": { schema: { $ref: "#/components/schemas/Problem" } } },
});

/**
 * The OpenAPI 3.1 document of the HTTP API, generated from the same zod
 * schemas that validate requests.
 */
export function openApiDocument(): Record<string, unknown> {
  const json = (ref: string) => ({ "application/json": { schema: { $ref: `#/components/schemas/${ref}` } } });
  return {
    openapi: "3.1.0",
    info: {
      title: "Oncely",
      version: "1.0.0",
      description: "Summarisation jobs accepted at most once per Idempotency-Key, with exactly-once effects.",
    },
    components: {
      securitySchemes: {
        apiKey: { type: "http", scheme: "bearer", description: "A key from `deno task tenant create`" },
      },
      schemas: {
        SummaryRequest: schema(SummaryRequest),
        SummaryAccepted: schema(SummaryAccepted),
        SummaryStatus: schema(SummaryStatus),
        Problem: schema(Problem),
      },
    },
    security: [{ apiKey: [] }],
    paths: {
      "/v1/summaries": {
        post: {
          operationId: "createSummary",
          summary: "Submit a document to summarise, at most once per Idempotency-Key",
          parameters: [{
            name: "Idempotency-Key",
            in: "header",
            required: true,
            schema: schema(IdempotencyKey),
            description: "16 to 128 visible ASCII characters; scoped to your tenant, method and path",
          }],
          requestBody: { required: true, content: json("SummaryRequest") },
          responses: {
            "202": {
              description: "Accepted (or a replay of the first response, with Idempotent-Replayed: true)",
              headers: {
                Location: { schema: { type: "string" } },
                "Idempotent-Replayed": { schema: { type: "string", enum: ["true"] } },
              },
              content: json("SummaryAccepted"),
            },
            "400": problem("Missing or malformed Idempotency-Key, or malformed JSON"),
            "401": problem("Missing or bad credentials"),
            "408": problem("The body did not arrive in time (the connection is closed)"),
            "413": problem("Body over MAX_BODY_BYTES"),
            "415": problem("Not JSON"),
            "422": problem("Body failed validation, or the key was used with another body"),
            "503": problem("The queue, or the tenant's part of it, is over its cap", {
              "Retry-After": { schema: { type: "string" } },
            }),
            "500": problem("Not stored: retry with the same key"),
          },
        },
      },
      "/v1/summaries/{job_id}": {
        get: {
          operationId: "getSummary",
          parameters: [{ name: "job_id", in: "path", required: true, schema: { type: "string", format: "uuid" } }],
          responses: {
            "200": { description: "The job's status", content: json("SummaryStatus") },
            "401": problem("Missing or bad credentials"),
            "404": problem("Unknown job, or another tenant's"),
          },
        },
      },
      "/healthz": { get: { security: [], responses: { "200": { description: "The process is alive" } } } },
      "/readyz": {
        get: {
          security: [],
          responses: {
            "200": { description: "Redis and Postgres answer" },
            "503": { description: "Redis or Postgres does not answer" },
          },
        },
      },
      "/metrics": {
        get: {
          security: [],
          responses: { "200": { description: "Prometheus text format", content: { "text/plain": {} } } },
        },
      },
      "/openapi.json": {
        get: {
          security: [],
          responses: { "200": { description: "This document", content: { "application/json": {} } } },
        },
      },
    },
  };
}
