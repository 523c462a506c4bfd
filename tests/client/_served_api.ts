/**
 * The real API on a loopback port, for the client's tests: its own database
 * and Redis, one tenant with an API key and a webhook secret, `Prefer: wait`
 * on, and a worker and a relay to start when a test wants jobs to finish.
 * Also a proxy that can answer some requests itself before forwarding.
 */
import type { CallOptions, Completion, LLM } from "../../src/llm/llm.ts";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { silentLogger } from "../../src/log/logger.ts";
import type { RedisClient } from "../../src/redis/client.ts";
import type { Relay } from "../../src/outbox/relay.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { type ServiceKeys, serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { ensureWebhookSecret } from "../../src/tenants/webhook_secrets.ts";
import { apiHandler, relayTo, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, type TestDatabase } from "../_support.ts";

/** What a task run's model answers when the task has an output schema. */
export const STRUCTURED_ANSWER = { category: "bug", urgent: true };

/** A running API. */
export interface ServedApi {
  url: string;
  db: TestDatabase;
  /** The API's Redis and its key names, to read what intake stored (a run's stream entry, its status record). */
  redis: RedisClient;
  keys: ServiceKeys;
  apiKey: string;
  /** The tenant's webhook signing secret (`whsec_...`). */
  secret: string;
  /** Every prompt the model was sent, by any worker started here. */
  prompts: string[];
  /** Starts a summary worker; `stop` finishes its current jobs and closes it. */
  startWorker(): { stop(): Promise<void> };
  /** A relay that sends webhooks to loopback receivers (and accepts every email). */
  relay: Relay;
  close(): Promise<void>;
}

/** Serves the API of a fresh database and Redis on 127.0.0.1; `close` ends all of it. */
export async function serveTestApi(): Promise<ServedApi> {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const apiKey = await createApiKey(db.sql, "acme");
  const secret = (await ensureWebhookSecret(db.sql, "acme"))!;
  const prompts: string[] = [];
  const extractive = createExtractiveLlm();
  const llm: LLM = {
    complete(prompt: string, options: CallOptions): Promise<Completion> {
      prompts.push(prompt);
      if (options.jsonSchema) return Promise.resolve({ text: JSON.stringify(STRUCTURED_ANSWER) });
      return extractive.complete(prompt, options);
    },
  };
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", waiter });
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, (req) => handler(req));
  const relay = relayTo(
    { sql: db.sql, mailer: { send: () => Promise.resolve({ ok: true }) } },
    { backoffBaseMs: 1, backoffCapMs: 5 },
  );
  const workers = new Set<() => Promise<void>>();
  let n = 0;
  return {
    url: `http://127.0.0.1:${server.addr.port}`,
    db,
    redis: r.redis,
    keys,
    apiKey,
    secret,
    prompts,
    relay,
    startWorker() {
      const abort = new AbortController();
      const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, { consumer: `client-test-${++n}` });
      const running = worker.run(abort.signal);
      const stop = async () => {
        workers.delete(stop);
        abort.abort();
        await running;
        await worker.close();
      };
      workers.add(stop);
      return { stop };
    },
    async close() {
      await server.shutdown();
      for (const stop of [...workers]) await stop();
      await waiter.close();
      await r.close();
      await db.close();
    },
  };
}

/** One request a proxy saw. */
export interface ProxiedRequest {
  /** `performance.now()` when it arrived. */
  at: number;
  method: string;
  path: string;
  headers: Headers;
}

/** A proxy in front of the API. */
export interface Proxy {
  url: string;
  readonly requests: ProxiedRequest[];
  close(): Promise<void>;
}

/**
 * Serves a proxy to `target` on 127.0.0.1: request n (from 1) is answered
 * by `answer(n)` when it returns a response, else forwarded.
 */
export function startProxy(target: string, answer: (n: number) => Response | undefined = () => undefined): Proxy {
  const requests: ProxiedRequest[] = [];
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
    const url = new URL(req.url);
    requests.push({ at: performance.now(), method: req.method, path: url.pathname, headers: req.headers });
    const scripted = answer(requests.length);
    if (scripted) {
      await req.body?.cancel();
      return scripted;
    }
    const body = req.body ? await req.arrayBuffer() : undefined;
    const res = await fetch(`${target}${url.pathname}${url.search}`, {
      method: req.method,
      headers: req.headers,
      body,
    });
    return new Response(await res.arrayBuffer(), { status: res.status, headers: res.headers });
  });
  return { url: `http://127.0.0.1:${server.addr.port}`, requests, close: () => server.shutdown() };
}
