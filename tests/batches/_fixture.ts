/** What the batch tests share: a database, the fake provider with its Batch API, and batch runs recorded. */
import type { Sql } from "postgres";
import { createBatchClient } from "../../src/batches/batch_client.ts";
import { createBatchIntake } from "../../src/batches/batch_intake.ts";
import type { DeploymentSpec } from "../../src/llm/deployment_specs.ts";
import { silentLogger } from "../../src/log/logger.ts";
import type { BatchIntake } from "../../src/runs/run_deps.ts";
import { createTestDatabase, type TestDatabase } from "../_support.ts";
import type { BatchScript } from "../support/fake_batch_api.ts";
import { type FakeModelServer, startFakeModel } from "../support/fake_model_server.ts";

export const DEPLOYMENT = "east";
export const MODEL = "gpt-test";

/** A batch run's stream payload: the built-in summarize task, as a task run with priority batch. */
export function batchPayload(text: string, notify = "ops@example.com"): string {
  return JSON.stringify({ task: "summarize", version: 1, input: { text }, notify, priority: "batch" });
}

/** One test's world; `close` ends it all. */
export interface BatchWorld {
  db: TestDatabase;
  sql: Sql;
  server: FakeModelServer;
  intake: BatchIntake;
  clients: Map<string, ReturnType<typeof createBatchClient>>;
  log: typeof silentLogger;
  /** Records `n` runs (fresh ids) into the open batch. @returns their ids. */
  recordRuns(n: number, tenant?: string): Promise<string[]>;
  close(): Promise<void>;
}

/** A world whose deployment `east` serves `gpt-test` with the Batch API, each batch going as `script` says. */
export async function batchWorld(
  { script = () => ({}), maxRuns = 5000 }: { script?: (n: number) => BatchScript; maxRuns?: number } = {},
): Promise<BatchWorld> {
  const db = await createTestDatabase();
  const server = startFakeModel(undefined, { batches: script });
  const spec: DeploymentSpec = {
    name: DEPLOYMENT,
    baseURL: server.url,
    apiKeyEnv: "LLM_KEY_EAST",
    apiKey: "k",
    models: [MODEL],
    weight: 1,
    batch: true,
  };
  const intake = createBatchIntake({ sql: db.sql }, { specs: [spec], defaultModel: MODEL, maxRuns })!;
  const clients = new Map([[DEPLOYMENT, createBatchClient({ apiKey: "k", baseURL: server.url })]]);
  return {
    db,
    sql: db.sql,
    server,
    intake,
    clients,
    log: silentLogger,
    async recordRuns(n, tenant = "acme") {
      const ids: string[] = [];
      for (let i = 0; i < n; i++) {
        const runId = crypto.randomUUID();
        ids.push(runId);
        await intake.record({
          runId,
          tenant,
          payload: batchPayload(`Document ${i}. It says something. Then something else.`),
          acceptedMs: Date.now(),
          call: { prompt: `Summarise document ${i}`, models: [], options: { maxOutputTokens: 64 } },
          target: { deployment: DEPLOYMENT, model: MODEL },
        });
      }
      return ids;
    },
    async close() {
      await server.close();
      await db.close();
    },
  };
}

/** A stop between two steps: what a test throws from a fault hook to leave the batch as a crash would. */
export class Crash extends Error {
  constructor(step: string) {
    super(`crash after ${step}`);
    this.name = "Crash";
  }
}

/** The batch rows, by state. */
export async function batchStates(
  sql: Sql,
): Promise<{ state: string; runs: number; provider_batch_id: string | null }[]> {
  return [
    ...await sql<{ state: string; runs: number; provider_batch_id: string | null }[]>`
    SELECT state, runs, provider_batch_id FROM batches ORDER BY opened_at`,
  ];
}
