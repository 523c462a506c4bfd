/**
 * A local HTTP server speaking the OpenAI Chat Completions wire format, for
 * tests, the chaos run and benchmarks. Each request is answered by
 * `respond`, which may return a scripted failure instead of a completion.
 */
import { summariseExtractively } from "../../src/llm/extractive.ts";
import { SUMMARY_INSTRUCTION } from "../../src/llm/llm.ts";
import { instanceOf } from "../../src/llm/schema_instance.ts";
import { type BatchScript, createFakeBatchApi, type FakeBatchApi, type FakeBatchApiOptions } from "./fake_batch_api.ts";

/** What the server does with one request. */
export type ModelBehaviour =
  | {
    kind: "ok";
    delayMs?: number;
    headers?: Record<string, string>;
    /**
     * The token counts the answer reports (default 1 and 1); `realistic`: counted from the request and the
     * answer, as a provider bills them (see {@linkcode realisticUsage}).
     */
    usage?: Usage | "realistic";
    /**
     * The answer's `usage` object exactly as given, whatever it holds (a negative or fractional count, a string,
     * `1e15`): what a misbehaving provider or gateway sends. Overrides `usage`; the request's entry in
     * {@linkcode FakeModelServer.usages} is then undefined.
     */
    rawUsage?: Record<string, unknown>;
    /**
     * The answer's text (JSON or not, for structured output). Unset: for a `json_schema` request, a value valid
     * against the schema (see {@linkcode STRUCTURED_MARKERS} for asking for a bad one); else an extractive
     * summary of the prompt.
     */
    content?: string;
  }
  | { kind: "status"; status: number; headers?: Record<string, string>; body?: unknown }
  | { kind: "hang" }
  | { kind: "drip"; intervalMs: number };

/**
 * Markers a task's input can carry (the rendered prompt holds them) to make the fake model's structured answer
 * bad: `breaksOnce` answers text that is not JSON, then a valid value to the repair call; `breaksAlways`
 * answers JSON that breaks the schema (an empty object) to every call.
 */
export const STRUCTURED_MARKERS = { breaksOnce: "[[invalid-json-once]]", breaksAlways: "[[breaks-schema]]" };

/** The answer to a structured-output request whose first user message is `firstPrompt`. */
function structuredAnswer(schema: unknown, firstPrompt: string, repair: boolean): string {
  if (firstPrompt.includes(STRUCTURED_MARKERS.breaksAlways)) return "{}";
  if (firstPrompt.includes(STRUCTURED_MARKERS.breaksOnce) && !repair) return "Sure! Here is the JSON you asked for";
  return JSON.stringify(instanceOf(schema));
}

/** Token counts as the provider reports them in a completion's `usage`. */
export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
}

/** A Chat Completions request body, as far as the fake reads it. */
export type ChatBody = {
  messages?: { role?: string; content?: string }[];
  model?: string;
  max_completion_tokens?: number;
  response_format?: { type?: string; json_schema?: { schema?: unknown } };
};

/**
 * What a provider bills for a request and its answer, counted from their lengths at about four characters a
 * token (rounded up): each message's content plus 4 tokens of chat framing, 3 more that prime the answer, and
 * a structured request's JSON schema, which providers count as prompt; the answer's text, at most the request's
 * `max_completion_tokens`.
 */
export function realisticUsage(body: ChatBody, answer: string): Usage {
  const tokens = (text: string) => Math.ceil(text.length / 4);
  let prompt = 3;
  for (const m of body.messages ?? []) prompt += tokens(m.content ?? "") + 4;
  const schema = body.response_format?.type === "json_schema" ? body.response_format.json_schema?.schema : undefined;
  if (schema !== undefined) prompt += tokens(JSON.stringify(schema));
  const cap = body.max_completion_tokens ?? Infinity;
  return { prompt_tokens: prompt, completion_tokens: Math.min(cap, Math.max(1, tokens(answer))) };
}

/**
 * The text the fake answers `body` with unless told otherwise: for a `json_schema` request, a value valid
 * against the schema (see {@linkcode STRUCTURED_MARKERS} for asking for a bad one); else an extractive summary
 * of the last message (the document, without the summary instruction).
 */
export function defaultAnswer(body: ChatBody): string {
  if (body.response_format?.type === "json_schema") {
    return structuredAnswer(
      body.response_format.json_schema?.schema,
      body.messages?.find((m) => m.role === "user")?.content ?? "",
      body.messages?.some((m) => m.role === "assistant") ?? false,
    );
  }
  const prompt = body.messages?.at(-1)?.content ?? "";
  const text = prompt.startsWith(SUMMARY_INSTRUCTION) ? prompt.slice(SUMMARY_INSTRUCTION.length) : prompt;
  return summariseExtractively(text.trim()) || "(empty)";
}

/** A running fake model. */
export interface FakeModelServer {
  /** Base URL for the SDK, ending in `/v1`. */
  url: string;
  /** Requests received so far. */
  requests: number;
  /** Prompts of the requests received, in order. */
  prompts: string[];
  /** The request bodies received, in order, as sent (messages, model, response_format, ...). */
  bodies: Record<string, unknown>[];
  /** When each request arrived (performance.now()), by request (n - 1). */
  arrivedAt: number[];
  /** The usage each request's answer reported, by request (n - 1); undefined unless answered `ok` (no `rawUsage`). */
  usages: (Usage | undefined)[];
  /** The Files and Batches endpoints (see `fake_batch_api.ts`): what they received, and their faults. */
  batches: FakeBatchApi;
  close(): Promise<void>;
}

/** A chat completion body with `content`. */
export function completionBody(
  content: string,
  model = "fake-model",
  usage: Usage = { prompt_tokens: 1, completion_tokens: 1 },
) {
  return {
    id: `chatcmpl-${crypto.randomUUID()}`,
    object: "chat.completion",
    created: Math.floor(Date.now() / 1000),
    model,
    choices: [{
      index: 0,
      message: { role: "assistant", content, refusal: null },
      finish_reason: "stop",
      logprobs: null,
    }],
    usage: { ...usage, total_tokens: usage.prompt_tokens + usage.completion_tokens },
  };
}

/** An OpenAI-style error body. */
export function errorBody(message: string, type: string, code: string | null = null) {
  return { error: { message, type, param: null, code } };
}

/**
 * Starts the server on an ephemeral loopback port. `batches` scripts each batch of its Batch API, and
 * `afterBatchStep` runs after each Files or Batches request's work, before its answer (see `fake_batch_api.ts`).
 */
export function startFakeModel(
  respond: (n: number, prompt: string) => ModelBehaviour = () => ({ kind: "ok" }),
  { batches: batchScript, afterBatchStep }: {
    batches?: (n: number) => BatchScript;
    afterBatchStep?: FakeBatchApiOptions["after"];
  } = {},
): FakeModelServer {
  const batches = createFakeBatchApi(batchScript, { after: afterBatchStep });
  const hangs = new Set<() => void>();
  const state = {
    requests: 0,
    prompts: [] as string[],
    bodies: [] as Record<string, unknown>[],
    usages: [] as (Usage | undefined)[],
    arrivedAt: [] as number[],
  };
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, async (req) => {
    const path = new URL(req.url).pathname.replace(/^\/v1/, "");
    const batchAnswer = batches.handle(req, path);
    if (batchAnswer) return await batchAnswer;
    if (!path.endsWith("/chat/completions")) return new Response("not found", { status: 404 });
    const arrived = performance.now();
    const body = await req.json() as ChatBody;
    const prompt = body.messages?.at(-1)?.content ?? "";
    const n = ++state.requests;
    state.prompts.push(prompt);
    state.bodies.push(body);
    state.arrivedAt.push(arrived);
    const behaviour = respond(n, prompt);
    switch (behaviour.kind) {
      case "ok": {
        if (behaviour.delayMs) await new Promise((r) => setTimeout(r, behaviour.delayMs));
        const content = behaviour.content ?? defaultAnswer(body);
        const usage = behaviour.usage === "realistic" ? realisticUsage(body, content) : behaviour.usage;
        // Billed once answered, whether or not the caller is still there to read it.
        state.usages[n - 1] = behaviour.rawUsage ? undefined : usage ?? { prompt_tokens: 1, completion_tokens: 1 };
        const completion = completionBody(content, body.model, usage);
        return Response.json(
          behaviour.rawUsage ? { ...completion, usage: behaviour.rawUsage } : completion,
          { headers: { "x-request-id": `req_${n}`, ...behaviour.headers } },
        );
      }
      case "status":
        return Response.json(behaviour.body ?? errorBody(`scripted ${behaviour.status}`, "server_error"), {
          status: behaviour.status,
          headers: behaviour.headers,
        });
      case "hang":
        // Never answers; close() releases every hung request.
        await new Promise<void>((resolve) => hangs.add(resolve));
        return new Response(null, { status: 499 });
      case "drip": {
        // Headers at once, then one byte per interval: never trips a read timeout.
        let timer: ReturnType<typeof setInterval> | undefined;
        const stream = new ReadableStream<Uint8Array>({
          start(controller) {
            controller.enqueue(new TextEncoder().encode("{"));
            timer = setInterval(() => controller.enqueue(new TextEncoder().encode(" ")), behaviour.intervalMs);
          },
          cancel() {
            clearInterval(timer);
          },
        });
        return new Response(stream, { headers: { "content-type": "application/json" } });
      }
    }
  });
  const addr = server.addr as Deno.NetAddr;
  return {
    url: `http://127.0.0.1:${addr.port}/v1`,
    get requests() {
      return state.requests;
    },
    get prompts() {
      return state.prompts;
    },
    get bodies() {
      return state.bodies;
    },
    get usages() {
      return state.usages;
    },
    get arrivedAt() {
      return state.arrivedAt;
    },
    batches,
    async close() {
      for (const release of hangs) release();
      await server.shutdown();
    },
  };
}

/** An outage a {@linkcode LimitedProvider} can be switched into. */
export type Outage = "quota" | "503" | null;

/** A provider that enforces a rate limit the way OpenAI does, and can go down. */
export interface LimitedProvider {
  /** `respond` for {@linkcode startFakeModel}. */
  respond(n: number, prompt: string): ModelBehaviour;
  /** Switches every answer to an outage (`quota`: 429 insufficient_quota; `503`), or back with null. */
  setOutage(outage: Outage): void;
  /**
   * A short pause, as a provider asks for one: every request for the next `ms` is answered `429
   * rate_limit_exceeded` with `retry-after-ms` the time left (counted in `rateLimited`).
   */
  pauseFor(ms: number): void;
  readonly counts: { ok: number; rateLimited: number; quota: number; unavailable: number };
}

function resetText(ms: number): string {
  if (ms < 1000) return `${Math.max(1, Math.ceil(ms))}ms`;
  const s = ms / 1000;
  return s < 60 ? `${s.toFixed(3).replace(/\.?0+$/, "")}s` : `${Math.floor(s / 60)}m${Math.round(s % 60)}s`;
}

/**
 * The rate limit of a real provider: at most `rps` requests in any sliding
 * second (OpenAI enforces its per-minute limits over such short windows),
 * advertised per minute in `x-ratelimit-*` headers on every answer, and
 * refused above it with `429 rate_limit_exceeded` and `retry-after-ms`.
 */
export function limitedProvider(
  { rps, tpm = 10_000_000, delayMs = 0 }: { rps: number; tpm?: number; delayMs?: number },
): LimitedProvider {
  const accepted: number[] = [];
  const tokens: { at: number; n: number }[] = [];
  const counts = { ok: 0, rateLimited: 0, quota: 0, unavailable: 0 };
  let outage: Outage = null;
  let pausedUntil = -Infinity;
  const rpm = rps * 60;
  let bucket = rpm;
  let bucketAt = performance.now();
  const headers = (now: number) => {
    while (tokens.length && tokens[0]!.at <= now - 60_000) tokens.shift();
    const usedTokens = tokens.reduce((sum, t) => sum + t.n, 0);
    // As OpenAI reports it: a per-minute budget that refills continuously.
    bucket = Math.min(rpm, bucket + ((now - bucketAt) / 60_000) * rpm);
    bucketAt = now;
    const remaining = Math.max(0, Math.floor(bucket));
    return {
      "x-ratelimit-limit-requests": String(rpm),
      "x-ratelimit-remaining-requests": String(remaining),
      "x-ratelimit-reset-requests": resetText(((rpm - remaining) / rpm) * 60_000),
      "x-ratelimit-limit-tokens": String(tpm),
      "x-ratelimit-remaining-tokens": String(Math.max(0, tpm - usedTokens)),
      "x-ratelimit-reset-tokens": resetText((usedTokens / tpm) * 60_000),
    };
  };
  return {
    counts,
    setOutage(next) {
      outage = next;
    },
    pauseFor(ms) {
      pausedUntil = performance.now() + ms;
    },
    respond(_n, prompt) {
      const now = performance.now();
      if (outage === "quota") {
        counts.quota++;
        return {
          kind: "status",
          status: 429,
          headers: headers(now),
          body: errorBody(
            "You exceeded your current quota, please check your plan and billing details.",
            "insufficient_quota",
            "insufficient_quota",
          ),
        };
      }
      if (outage === "503") {
        counts.unavailable++;
        return { kind: "status", status: 503, body: errorBody("The server is overloaded.", "server_error") };
      }
      while (accepted.length && accepted[0]! <= now - 1_000) accepted.shift();
      if (accepted.length >= rps || now < pausedUntil) {
        counts.rateLimited++;
        const retry = Math.max(1, Math.ceil(now < pausedUntil ? pausedUntil - now : accepted[0]! + 1_000 - now));
        return {
          kind: "status",
          status: 429,
          headers: { ...headers(now), "retry-after-ms": String(retry) },
          body: errorBody(
            `Rate limit reached on requests per min (RPM): Limit ${rpm}, Used ${rpm}, Requested 1. ` +
              `Please try again in ${retry}ms.`,
            "requests",
            "rate_limit_exceeded",
          ),
        };
      }
      accepted.push(now);
      bucket = Math.max(0, bucket - 1);
      counts.ok++;
      tokens.push({ at: now, n: Math.ceil(prompt.length / 4) + 1 });
      return { kind: "ok", delayMs, headers: headers(now) };
    },
  };
}
