/**
 * A local HTTP server speaking the OpenAI Chat Completions wire format, for
 * tests, the chaos run and benchmarks. Each request is answered by
 * `respond`, which may return a scripted failure instead of a completion.
 */
import { summariseExtractively } from "../llm/extractive.ts";
import { SUMMARY_INSTRUCTION } from "../llm/llm.ts";

/** What the server does with one request. */
export type ModelBehaviour =
  | { kind: "ok"; delayMs?: number }
  | { kind: "status"; status: number; headers?: Record<string, string>; body?: unknown }
  | { kind: "hang" }
  | { kind: "drip"; intervalMs: number };

/** A running fake model. */
export interface FakeModelServer {
  /** Base URL for the SDK, ending in `/v1`. */
  url: string;
  /** Requests received so far. */
  requests: number;
  /** Prompts of the requests received, in order. */
  prompts: string[];
  close(): Promise<void>;
}

/** A chat completion body with `content`. */
export function completionBody(content: string, model = "fake-model") {
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
    usage: { prompt_tokens: 1, completion_tokens: 1, total_tokens: 2 },
  };
}

/** An OpenAI-style error body. */
export function errorBody(message: string, type: string, code: string | null = null) {
  return { error: { message, type, param: null, code } };
}

/** Starts the server on an ephemeral loopback port. */
export function startFakeModel(
  respond: (n: number, prompt: string) => ModelBehaviour = () => ({ kind: "ok" }),
): FakeModelServer {
  const hangs = new Set<() => void>();
  const state = { requests: 0, prompts: [] as string[] };
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, async (req) => {
    if (!new URL(req.url).pathname.endsWith("/chat/completions")) return new Response("not found", { status: 404 });
    const body = await req.json() as { messages?: { content?: string }[]; model?: string };
    const prompt = body.messages?.at(-1)?.content ?? "";
    const n = ++state.requests;
    state.prompts.push(prompt);
    const behaviour = respond(n, prompt);
    switch (behaviour.kind) {
      case "ok": {
        if (behaviour.delayMs) await new Promise((r) => setTimeout(r, behaviour.delayMs));
        const text = prompt.startsWith(SUMMARY_INSTRUCTION) ? prompt.slice(SUMMARY_INSTRUCTION.length) : prompt;
        return Response.json(completionBody(summariseExtractively(text.trim()) || "(empty)", body.model));
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
    async close() {
      for (const release of hangs) release();
      await server.shutdown();
    },
  };
}
