/** Token counts the provider reported for one call. */
export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

/** One model answer: its text, and what the provider said about the call. */
export interface Completion {
  text: string;
  /** The provider's token accounting, when it sends one. */
  usage?: Usage;
  /** Response headers (rate-limit state), for a provider reached over HTTP. */
  headers?: Headers;
  /** The model that answered, as the provider names it. */
  model?: string;
  /** The provider's id of the request (`x-request-id`), for its support. */
  requestId?: string;
}

/** One turn of a conversation after the prompt. */
export interface ChatTurn {
  role: "assistant" | "user";
  content: string;
}

/** One message of a conversation as a chat request gives it (a run of the built-in `chat` task). */
export interface ChatMessage {
  role: "system" | "developer" | "user" | "assistant";
  content: string;
}

/** How to make one call; everything but `signal` is optional, with the deployment's defaults. */
export interface CallOptions {
  /** Aborts the call: an aborted call must stop paying. */
  signal: AbortSignal;
  /** The system message, before the prompt. */
  system?: string;
  /** The model to ask; the deployment's (OPENAI_MODEL) when unset. */
  model?: string;
  /** The output cap; {@linkcode MAX_OUTPUT_TOKENS} when unset. */
  maxOutputTokens?: number;
  temperature?: number;
  /**
   * Structured output: the answer must be JSON valid against `schema` (sent as a json_schema format, strict
   * unless `strict` is false).
   */
  jsonSchema?: { name: string; schema: unknown; strict?: boolean };
  /** The answer must be a JSON object (`response_format: json_object`), with no schema. */
  jsonObject?: boolean;
  /**
   * The whole conversation as the request gave it (a chat run): sent as it is, instead of `system`, the prompt
   * and `followUp`.
   */
  messages?: readonly ChatMessage[];
  /** Turns after the prompt: a repair call sends the model's answer back, then what was wrong with it. */
  followUp?: ChatTurn[];
}

/** A chat-completion model. */
export interface LLM {
  /** Completes `prompt` (the user message) as `options` say. */
  complete(prompt: string, options: CallOptions): Promise<Completion>;
}

/** The most tokens a summary may use; sent as the call's output cap and reserved by the rate limiter. */
export const MAX_OUTPUT_TOKENS = 1024;

/** The instruction that precedes the document text (which is passed verbatim). */
export const SUMMARY_INSTRUCTION = "Summarise the following document for the account team in a few sentences.";

/** The prompt for a document: the instruction, then the text verbatim. */
export function summaryPrompt(text: string): string {
  return `${SUMMARY_INSTRUCTION}\n\n${text}`;
}

/**
 * What a call may cost in tokens before the provider has said: the prompt's
 * size (about four characters a token for English, rounded up, plus the chat
 * framing) and the output cap. The limiter reserves this, then settles
 * against the reported usage.
 */
export function estimateTokens(prompt: string, maxOutputTokens = MAX_OUTPUT_TOKENS): number {
  return estimateTokensOfLength(prompt.length, maxOutputTokens);
}

/** {@linkcode estimateTokens} for a prompt of `chars` characters, without building it. */
export function estimateTokensOfLength(chars: number, maxOutputTokens = MAX_OUTPUT_TOKENS): number {
  return Math.ceil(chars / 4) + 8 + maxOutputTokens;
}
