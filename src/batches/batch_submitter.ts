/**
 * The batch submitter: closes open batches that have waited `BATCH_MAX_WAIT_S`, and takes each closed batch
 * through its upload and creation at the provider, one recorded state at a time (migration 020):
 *
 *   closed -> uploading (lines fixed: the intent) -> upload -> uploaded (file id) -> creating (the intent) ->
 *   create -> submitted (provider batch id)
 *
 * Each state is written before the next step's effect at the provider, and each write is a compare-and-set on
 * the state. A process killed between two steps leaves the batch in the state of the last write, leased until
 * its lease runs out; the next process resumes there:
 * - in `uploading`, it uploads again (the first file, if it got there, is an orphan that costs nothing);
 * - in `creating`, the first upload may have led to a batch the provider created before the process died: it
 *   searches the provider's batches for our id in their `metadata` and records that one, and creates one only
 *   when none is found. A batch is never created twice: this is what a retried POST (which takes no
 *   idempotency key) gets wrong.
 *
 * An upload or a create the provider refuses for good (`BatchRefused`: a 4xx but 408, 409, 429) ends the batch:
 * `uploading` or `creating` -> `ended`, provider status `refused`, no file. The poller then settles its lines as
 * those of a batch that failed validation at the provider: BATCH_ON_EXPIRY sends them online or fails them. Any
 * other error (a 408, 409, 429 or 5xx, a timeout, a connection error) leaves the batch where it is, and a later
 * pass tries the step again.
 */
import type { Sql } from "postgres";
import type { Logger } from "../log/logger.ts";
import { passEvery } from "./_pass_loop.ts";
import { type BatchClient, BatchRefused, type ProviderBatch } from "./batch_client.ts";
import {
  type BatchLineOutcome,
  batchLines,
  type BatchRow,
  closeDueBatches,
  fixBatchLines,
  type HeldLease,
  leaseBatch,
  moveBatch,
  whileLeased,
} from "./batch_store.ts";

/** The steps after which a test may stop the submitter (a crash between this step and the next). */
export type SubmitStep = "lines_fixed" | "uploaded" | "upload_recorded" | "creating" | "created";

/**
 * The provider status recorded for a batch whose upload or create the provider refused (`batches.provider_status`,
 * with no provider batch id): its runs' lines are settled as unfinished, `BatchExpired: batch refused` under
 * `BATCH_ON_EXPIRY=fail`.
 */
export const REFUSED_STATUS = "refused";

/** Defaults of {@linkcode createBatchSubmitter}. */
export const SUBMITTER_DEFAULTS = {
  /** How often it looks for batches to close and submit. */
  intervalMs: 1_000,
  /**
   * How long a process holds a batch while it takes a step of it, renewed every third of it while the step runs:
   * how long a batch whose process was killed waits before the next one resumes it.
   */
  leaseMs: 30_000,
  /** How far before the `creating` intent the search for our batch at the provider starts (clocks differ). */
  searchSlackS: 600,
  /** The most batches one pass advances. */
  perPass: 20,
} as const;

/** Options for {@linkcode createBatchSubmitter}. */
export interface SubmitterOptions {
  /** BATCH_MAX_WAIT_S, in ms. */
  maxWaitMs: number;
  leaseMs?: number;
  intervalMs?: number;
  /** Called with the lines left out of a batch's file (its runs decided before the upload), once: the metrics. */
  onSettled?: (outcome: Extract<BatchLineOutcome, "left_out">, lines: number, deployment: string) => void;
  /** Called after each step (tests throw here to stop the submitter between two steps). */
  fault?: (step: SubmitStep, batchId: string) => void | Promise<void>;
}

/** The submitter service. */
export interface BatchSubmitter {
  /** One pass: closes due batches, then advances the closed ones. @returns how many batches it advanced. */
  runOnce(): Promise<number>;
  /** Passes every `intervalMs` until `signal` aborts (the current pass finishes first). */
  run(signal: AbortSignal): Promise<void>;
}

/** The submitter over the batch deployments' clients (by deployment name). */
export function createBatchSubmitter(
  { sql, clients, log }: { sql: Sql; clients: ReadonlyMap<string, BatchClient>; log: Logger },
  options: SubmitterOptions,
): BatchSubmitter {
  const leaseMs = options.leaseMs ?? SUBMITTER_DEFAULTS.leaseMs;
  const fault = options.fault ?? (() => {});

  // A refusal for good ends the batch (a compare-and-set, as every step): sending the same request again would only
  // be refused again, for ever. The poller settles its lines per BATCH_ON_EXPIRY, as a failed batch's.
  const endRefused = async (batch: BatchRow, from: "uploading" | "creating", refusal: BatchRefused) => {
    const ended = await moveBatch(sql, batch.id, from, "ended", { provider_status: REFUSED_STATUS });
    log.error("batch_refused", {
      batch_id: batch.id,
      deployment: batch.deployment,
      step: refusal.step,
      status: refusal.status,
      provider_message: refusal.providerMessage,
      ended,
    });
  };

  const advance = async (batch: BatchRow, { signal, confirm }: HeldLease): Promise<void> => {
    const client = clients.get(batch.deployment);
    if (!client) return log.warn("batch_deployment_unknown", { batch_id: batch.id, deployment: batch.deployment });
    const { id } = batch;
    let state = batch.state;
    let inputFileId = batch.input_file_id;
    // Set when this process wrote `creating` itself: it has not called create yet, so there is nothing to find.
    let freshIntent = false;
    if (state === "closed") {
      const lines = await fixBatchLines(sql, id);
      if (lines === null) return;
      // Leased `closed`, so its `runs` was final: the runs not in the file are those fixBatchLines left out.
      if (batch.runs > lines) options.onSettled?.("left_out", batch.runs - lines, batch.deployment);
      await fault("lines_fixed", id);
      if (lines === 0) {
        // Every run was cancelled (or decided) before the upload: nothing to send.
        await moveBatch(sql, id, "uploading", "committed");
        return log.info("batch_empty", { batch_id: id });
      }
      state = "uploading";
    }
    if (state === "uploading") {
      const lines = await batchLines(sql, id);
      const jsonl = lines.map((l) =>
        JSON.stringify({ custom_id: l.run_id, method: "POST", url: "/v1/chat/completions", body: l.request })
      ).join("\n") + "\n";
      try {
        inputFileId = await client.upload(jsonl, `oncely-batch-${id}.jsonl`, signal);
      } catch (error) {
        if (error instanceof BatchRefused) {
          return await endRefused(batch, "uploading", error);
        }
        throw error;
      }
      await fault("uploaded", id);
      if (!await moveBatch(sql, id, "uploading", "uploaded", { input_file_id: inputFileId })) {
        return;
      }
      log.info("batch_uploaded", { batch_id: id, lines: lines.length, input_file_id: inputFileId });
      await fault("upload_recorded", id);
      state = "uploaded";
    }
    if (state === "uploaded") {
      // The intent, written before the POST: a process that finds a batch in `creating` searches before it creates.
      if (!await moveBatch(sql, id, "uploaded", "creating")) return;
      freshIntent = true;
      await fault("creating", id);
      state = "creating";
    }
    if (state === "creating") {
      const since = Math.floor((batch.creating_at?.getTime() ?? Date.now()) / 1000) - SUBMITTER_DEFAULTS.searchSlackS;
      const found = freshIntent ? undefined : await client.findByMetadata(id, since);
      if (found) log.info("batch_found_again", { batch_id: id, provider_batch_id: found.id });
      // Still this process's batch, just before the one effect nothing undoes (a second create is paid twice).
      if (!found) await confirm();
      let created: ProviderBatch;
      try {
        created = found ?? await client.create(inputFileId!, id, signal);
      } catch (error) {
        // A create refused for good made no batch: ending ours leaves nothing running at the provider.
        if (error instanceof BatchRefused) return await endRefused(batch, "creating", error);
        throw error;
      }
      await fault("created", id);
      await moveBatch(sql, id, "creating", "submitted", {
        provider_batch_id: created.id,
        provider_status: created.status,
      });
      log.info("batch_submitted", { batch_id: id, provider_batch_id: created.id });
    }
  };

  const runOnce = async () => {
    await closeDueBatches(sql, { maxWaitMs: options.maxWaitMs });
    let advanced = 0;
    const held = new Set<string>();
    while (advanced < SUBMITTER_DEFAULTS.perPass) {
      const batch = await leaseBatch(sql, ["closed", "uploading", "uploaded", "creating"], { leaseMs });
      if (!batch || held.has(batch.id)) break;
      held.add(batch.id);
      try {
        await whileLeased(
          sql,
          batch,
          leaseMs,
          (lease) => advance(batch, lease),
          () => log.warn("batch_lease_lost", { batch_id: batch.id, state: batch.state }),
        );
      } catch (error) {
        // Kept leased: the provider or Postgres failed mid-step; the next try waits for the lease.
        log.warn("batch_submit_failed", { batch_id: batch.id, state: batch.state, error });
        throw error;
      }
      advanced++;
    }
    return advanced;
  };

  return {
    runOnce,
    run: (signal) => passEvery(options.intervalMs ?? SUBMITTER_DEFAULTS.intervalMs, signal, runOnce),
  };
}
