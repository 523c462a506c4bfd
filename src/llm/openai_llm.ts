import OpenAI from "openai";
import { type CallOptions, type LLM, MAX_OUTPUT_TOKENS } from "./llm.ts";
import { fromOpenAiError } from "./openai_errors.ts";
import { checkUsage } from "./provider_usage.ts";
import { type Logger, silentLogger } from "../log/logger.ts";

/** Options for {@linkcode createOpenAiLlm}. */
export interface OpenAiOptions {
  apiKey: string;
  model: string;
  /** Any OpenAI-compatible server; the SDK's default when unset. */
  baseURL?: string;
  fetch?: typeof fetch;
  /** Where a usage the provider reported and we refused is logged (`provider_usage_invalid`); silent when unset. */
  log?: Logger;
}

/**
 * The longest answer a call may return, in characters (UTF-16 code units, as `String.length` counts): a
 * million. No task asks for more than 16,384 output tokens, and a token is a few characters (rarely more than
 * 64), so a real answer is far below it; past it, the answer is a provider's or a gateway's fault, and storing
 * it would put megabytes into a run's row, its cache entry, its email and its webhook.
 */
export const MAX_ANSWER_CHARS = 1_000_000;

/**
 * The most bytes of a response body read: what an answer of {@linkcode MAX_ANSWER_CHARS} can take in JSON (six
 * bytes a character when every one is escaped as `\uXXXX`) and 64 KiB for the rest of the document. Past it,
 * the body is not read further, so a 20 MB answer never sits whole in memory.
 */
export const MAX_RESPONSE_BYTES = 6 * MAX_ANSWER_CHARS + 65_536;

/** An empty or missing completion; not retryable (it is not a transport failure). */
export class EmptyCompletion extends Error {
  constructor(message = "The model returned no text", options?: ErrorOptions) {
    super(message, options);
    this.name = "EmptyCompletion";
  }
}

/**
 * An answer longer than {@linkcode MAX_ANSWER_CHARS} (or a response body past {@linkcode MAX_RESPONSE_BYTES}):
 * a permanent model error of the run, not retryable (the same request would most likely get the same answer).
 */
export class AnswerTooLarge extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "AnswerTooLarge";
  }
}

/**
 * `fetch` whose response bodies end in an {@linkcode AnswerTooLarge} error once they pass `maxBytes` (at once
 * when `content-length` says so). The error comes from reading the body, not from `fetch` itself: the SDK
 * turns a failed `fetch` into a connection error, which would be retried.
 */
export function boundedFetch(inner: typeof fetch, maxBytes: number): typeof fetch {
  return async (input, init) => {
    const response = await inner(input, init);
    if (response.body === null) return response;
    const declared = Number(response.headers.get("content-length") ?? NaN);
    // A body of a declared length within the bound, not compressed, is passed on as it is: HTTP's framing ends it
    // at that length, so nothing can run past the bound, and the usual answer costs no stream of ours (a stream
    // per call cost the worker throughput at 200 ms: see README, "Model calls").
    if (declared <= maxBytes && !response.headers.has("content-encoding")) return response;
    const tooLarge = (bytes: string) =>
      new AnswerTooLarge(`the model provider's response is ${bytes} bytes, over the limit of ${maxBytes}`);
    let read = 0;
    const limit = new TransformStream<Uint8Array, Uint8Array>({
      start(controller) {
        if (declared > maxBytes) controller.error(tooLarge(String(declared)));
      },
      transform(chunk, controller) {
        read += chunk.byteLength;
        if (read > maxBytes) controller.error(tooLarge(`more than ${maxBytes}`));
        else controller.enqueue(chunk);
      },
    });
    const body = response.body.pipeThrough(limit);
    return new Response(body, { status: response.status, statusText: response.statusText, headers: response.headers });
  };
}

/**
 * The Chat Completions body of a call to `model`: what the online call sends, and what a batch line carries
 * (`batch_intake.ts`), so a batch answer is the answer the run would have had online.
 */
export function chatCompletionBody(
  prompt: string,
  call: Omit<CallOptions, "signal" | "model">,
  model: string,
): OpenAI.ChatCompletionCreateParamsNonStreaming {
  return {
    model,
    messages: call.messages ? [...call.messages] : [
      ...(call.system === undefined ? [] : [{ role: "system" as const, content: call.system }]),
      { role: "user", content: prompt },
      ...(call.followUp ?? []),
    ],
    max_completion_tokens: call.maxOutputTokens ?? MAX_OUTPUT_TOKENS,
    ...(call.temperature === undefined ? {} : { temperature: call.temperature }),
    ...(call.jsonSchema === undefined ? {} : {
      response_format: {
        type: "json_schema" as const,
        json_schema: {
          name: call.jsonSchema.name,
          schema: call.jsonSchema.schema as Record<string, unknown>,
          strict: call.jsonSchema.strict ?? true,
        },
      },
    }),
    ...(call.jsonObject ? { response_format: { type: "json_object" as const } } : {}),
  };
}

/**
 * An {@linkcode LLM} on OpenAI-compatible Chat Completions. Its errors are
 * the service's transport errors (see `openai_errors.ts`). The SDK's own
 * retries are off (`maxRetries: 0`): the retry policy is the only layer that
 * retries, or four attempts would become twelve requests.
 */
export function createOpenAiLlm(options: OpenAiOptions): LLM {
  const log = options.log ?? silentLogger;
  const client = new OpenAI({
    apiKey: options.apiKey,
    baseURL: options.baseURL,
    maxRetries: 0,
    fetch: boundedFetch(options.fetch ?? fetch, MAX_RESPONSE_BYTES),
  });
  return {
    async complete(prompt, call) {
      // withResponse() keeps the headers: the shared limiter learns the provider's limits from them.
      const { data, response } = await client.chat.completions.create(
        chatCompletionBody(prompt, call, call.model ?? options.model),
        { signal: call.signal },
      ).withResponse().catch((error) => {
        throw fromOpenAiError(error);
      });
      const requestId = response.headers.get("x-request-id") ?? undefined;
      // A usage we refuse is unknown usage from here on: the call is charged its reservation, like an answer that
      // reported none. Logged here, once per call, before the answer is judged (a refused answer was billed too).
      const { usage, refused } = checkUsage(data.usage);
      if (refused) log.warn("provider_usage_invalid", { ...refused, model: data.model, request_id: requestId });
      const text = data.choices[0]?.message?.content;
      if (typeof text === "string" && text.length > MAX_ANSWER_CHARS) {
        throw new AnswerTooLarge(
          `the model's answer is ${text.length} characters, over the limit of ${MAX_ANSWER_CHARS} (MAX_ANSWER_CHARS)`,
        );
      }
      if (!text || !text.trim()) throw new EmptyCompletion();
      return {
        text: text.trim(),
        usage,
        headers: response.headers,
        model: data.model,
        requestId,
      };
    },
  };
}
