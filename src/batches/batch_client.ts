/**
 * A deployment's Files and Batches API (OpenAI's Batch API, through the `openai` SDK), as the batch services use
 * it. The SDK's own retries are off: a `POST /v1/batches` takes no idempotency key, so a retried POST whose first
 * answer was lost creates a second batch, paid twice. Our retry is the batch's record in Postgres and
 * {@linkcode BatchClient.findByMetadata}, which finds a batch that was created before its answer was lost.
 */
import OpenAI, { toFile } from "openai";
import { fromOpenAiError } from "../llm/openai_errors.ts";

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
  /** Uploads a JSONL file with `purpose: batch`. @returns its file id. */
  upload(jsonl: string, filename: string, signal?: AbortSignal): Promise<string>;
  /**
   * Creates a batch on `/v1/chat/completions` with a 24 h window, its metadata naming our batch. `signal` stops
   * the request (the process lost its lease on the batch).
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

/** The Batch API of an OpenAI-compatible deployment. Its errors are the service's transport errors. */
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
  return {
    upload: (jsonl, filename, signal) =>
      wrap(async () => {
        const file = await toFile(new TextEncoder().encode(jsonl), filename, { type: "application/jsonl" });
        return (await client.files.create({ file, purpose: "batch" }, { signal })).id;
      }),
    create: (inputFileId, ourId, signal) =>
      wrap(async () =>
        await client.batches.create({
          input_file_id: inputFileId,
          endpoint: "/v1/chat/completions",
          completion_window: "24h",
          metadata: { [BATCH_METADATA_KEY]: ourId },
        }, { signal }) as ProviderBatch
      ),
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
