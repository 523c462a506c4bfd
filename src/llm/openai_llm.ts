import OpenAI from "openai";
import { type LLM, MAX_OUTPUT_TOKENS } from "./llm.ts";
import { fromOpenAiError } from "./openai_errors.ts";

/** Options for {@linkcode createOpenAiLlm}. */
export interface OpenAiOptions {
  apiKey: string;
  model: string;
  /** Any OpenAI-compatible server; the SDK's default when unset. */
  baseURL?: string;
  fetch?: typeof fetch;
}

/** An empty or missing completion; not retryable (it is not a transport failure). */
export class EmptyCompletion extends Error {
  constructor(message = "The model returned no text", options?: ErrorOptions) {
    super(message, options);
    this.name = "EmptyCompletion";
  }
}

/**
 * An {@linkcode LLM} on OpenAI-compatible Chat Completions. Its errors are
 * the service's transport errors (see `openai_errors.ts`). The SDK's own
 * retries are off (`maxRetries: 0`): the retry policy is the only layer that
 * retries, or four attempts would become twelve requests.
 */
export function createOpenAiLlm(options: OpenAiOptions): LLM {
  const client = new OpenAI({
    apiKey: options.apiKey,
    baseURL: options.baseURL,
    maxRetries: 0,
    fetch: options.fetch,
  });
  return {
    async complete(prompt, call) {
      // withResponse() keeps the headers: the shared limiter learns the provider's limits from them.
      const { data, response } = await client.chat.completions.create({
        model: call.model ?? options.model,
        messages: [
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
              strict: true,
            },
          },
        }),
      }, { signal: call.signal }).withResponse().catch((error) => {
        throw fromOpenAiError(error);
      });
      const text = data.choices[0]?.message?.content;
      if (!text || !text.trim()) throw new EmptyCompletion();
      const usage = data.usage
        ? {
          prompt_tokens: data.usage.prompt_tokens,
          completion_tokens: data.usage.completion_tokens,
          total_tokens: data.usage.total_tokens,
        }
        : undefined;
      return {
        text: text.trim(),
        usage,
        headers: response.headers,
        model: data.model,
        requestId: response.headers.get("x-request-id") ?? undefined,
      };
    },
  };
}
