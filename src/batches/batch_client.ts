/**
 * A deployment's Files and Batches API (OpenAI's Batch API, through the `openai` SDK), as the batch services use
 * it. The SDK's own retries are off: a `POST /v1/batches` takes no idempotency key, so a retried POST whose first
 * answer was lost creates a second batch, paid twice. Our retry is the batch's record in Postgres and
 * {@linkcode BatchClient.findByMetadata}, which finds a batch that was created before its answer was lost.
 */
import OpenAI, { toFile } from "openai";
import { fromOpenAiError } from "../llm/openai_errors.ts";
import { UpstreamHttpError } from "../retry/errors.ts";

/** The metadata key that carries our batch id on the provider's batch. */
export const BATCH_METADATA_KEY = "oncely_batch";

/** The provider's statuses of a batch (openai-node's `Batch.status`). */
export type ProviderBatchStatus =
  | "validating"
  | "failed"
  | "in_progress"
  | "finalizing"
  | "completed"
  | "expired"
  | "cancelling"
  | "cancelled";

/** The statuses after which a batch changes no more. */
export const ENDED_STATUSES: ReadonlySet<string> = new Set(["completed", "expired", "cancelled", "failed"]);

/**
 * The 4xx answers to an upload or a create that may go another way later, so they are retried like a 5xx: 408
 * (request timeout), 409 (conflict: a state the provider may leave) and 429 (rate limit, or a quota that is topped
 * up). Every other 4xx (400, 401, 403, 404, 413, 422, ...) is a refusal ({@linkcode isRefusal}).
 */
export const RETRIED_4XX: ReadonlySet<number> = new Set([408, 409, 429]);

/** Whether an upload's or a create's answer status is a refusal for good: a 4xx not in {@linkcode RETRIED_4XX}. */
export function isRefusal(status: number): boolean {
  return status >= 400 && status < 500 && !RETRIED_4XX.has(status);
}

/** The longest provider message a refusal keeps (it is logged). */
const REFUSAL_MESSAGE_CHARS = 500;

/**
 * The provider refused an upload (`POST /v1/files`) or a create (`POST /v1/batches`) for good
 * ({@linkcode isRefusal}): sending the same request again gets the same answer. A refused create created no batch.
 * Its `cause` is the {@linkcode UpstreamHttpError}.
 */
export class BatchRefused extends Error {
  constructor(
    readonly step: "upload" | "create",
    readonly status: number,
    /** The provider's error message (at most 500 characters), never the file's lines. */
    readonly providerMessage: string,
    options?: ErrorOptions,
  ) {
    super(`the provider refused the batch's ${step} with ${status}: ${providerMessage}`, options);
    this.name = "BatchRefused";
  }
}

/** The message of the provider's error document (as `fromOpenAiError` keeps it), else its text, bounded. */
function providerMessage(body: string): string {
  let message: unknown;
  try {
    message = (JSON.parse(body) as { message?: unknown } | null)?.message;
  } catch {
    // Not JSON (a proxy's page): its text.
  }
  return (typeof message === "string" ? message : body).slice(0, REFUSAL_MESSAGE_CHARS);
}

/** A provider batch, as far as we read it. */
export interface ProviderBatch {
  id: string;
  status: ProviderBatchStatus;
  output_file_id?: string | null;
  error_file_id?: string | null;
  metadata?: Record<string, string> | null;
  created_at: number;
}

/** The Files and Batches API of one deployment. */
export interface BatchClient {
  /**
   * Uploads a JSONL file with `purpose: batch`. @returns its file id.
   * @throws {BatchRefused} when the provider refuses it for good (a 4xx but 408, 409, 429).
   */
  upload(jsonl: string, filename: string, signal?: AbortSignal): Promise<string>;
  /**
   * Creates a batch on `/v1/chat/completions` with a 24 h window, its metadata naming our batch. `signal` stops
   * the request (the process lost its lease on the batch).
   * @throws {BatchRefused} when the provider refuses it for good (a 4xx but 408, 409, 429): no batch was created.
   */
  create(inputFileId: string, ourId: string, signal?: AbortSignal): Promise<ProviderBatch>;
  retrieve(providerBatchId: string): Promise<ProviderBatch>;
  /**
   * The provider's batch whose metadata names our batch, searched newest first among the batches created since
   * `sinceS` (epoch seconds); undefined when none was.
   */
  findByMetadata(ourId: string, sinceS: number): Promise<ProviderBatch | undefined>;
  cancel(providerBatchId: string): Promise<void>;
  /** A file's content (an output or error file: JSONL). */
  content(fileId: string): Promise<string>;
}

/** Options for {@linkcode createBatchClient}. */
export interface BatchClientOptions {
  apiKey: string;
  baseURL: string;
  fetch?: typeof fetch;
  /** Per request (an upload of 200 MB takes a while). */
  timeoutMs?: number;
}

/**
 * The Batch API of an OpenAI-compatible deployment. Its errors are the service's transport errors, and a
 * {@linkcode BatchRefused} for an upload or create refused for good.
 */
export function createBatchClient(options: BatchClientOptions): BatchClient {
  const client = new OpenAI({
    apiKey: options.apiKey,
    baseURL: options.baseURL,
    maxRetries: 0,
    timeout: options.timeoutMs ?? 120_000,
    ...(options.fetch ? { fetch: options.fetch } : {}),
  });
  const wrap = async <T>(call: () => Promise<T>): Promise<T> => {
    try {
      return await call();
    } catch (error) {
      throw fromOpenAiError(error);
    }
  };
  // An upload or a create the provider refused for good: the submitter ends the batch rather than send it again.
  const refusable = async <T>(step: BatchRefused["step"], call: () => Promise<T>): Promise<T> => {
    try {
      return await wrap(call);
    } catch (error) {
      if (!(error instanceof UpstreamHttpError) || !isRefusal(error.status)) throw error;
      throw new BatchRefused(step, error.status, providerMessage(error.body), { cause: error });
    }
  };
  return {
    upload: (jsonl, filename, signal) =>
      refusable("upload", async () => {
        const file = await toFile(new TextEncoder().encode(jsonl), filename, { type: "application/jsonl" });
        return (await client.files.create({ file, purpose: "batch" }, { signal })).id;
      }),
    create: (inputFileId, ourId, signal) =>
      refusable("create", async () =>
        await client.batches.create({
          input_file_id: inputFileId,
          endpoint: "/v1/chat/completions",
          completion_window: "24h",
          metadata: { [BATCH_METADATA_KEY]: ourId },
        }, { signal }) as ProviderBatch),
    retrieve: (id) => wrap(async () => await client.batches.retrieve(id) as ProviderBatch),
    findByMetadata: (ourId, sinceS) =>
      wrap(async () => {
        for await (const batch of client.batches.list({ limit: 100 })) {
          if (batch.metadata?.[BATCH_METADATA_KEY] === ourId) return batch as ProviderBatch;
          // Newest first: past the batch's own intent, no older batch can be ours.
          if (batch.created_at < sinceS) return undefined;
        }
        return undefined;
      }),
    cancel: (id) => wrap(async () => void await client.batches.cancel(id)),
    content: (fileId) => wrap(async () => await (await client.files.content(fileId)).text()),
  };
}
