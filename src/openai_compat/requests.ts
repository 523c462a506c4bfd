/**
 * The OpenAI-compatible request bodies, read into a run of the built-in `chat` task: a Chat Completions
 * request and a Responses request both become a {@linkcode ChatInput} (the conversation as given, the model,
 * the output cap, temperature and format). What the door does not support (tools, `n` > 1, audio, images,
 * logprobs) and any field it does not know is a `422` naming the field, never silently dropped.
 */
import type { ChatMessage } from "../llm/llm.ts";
import { CHAT_MAX_OUTPUT_TOKENS, ChatFormat, ChatInput } from "../tasks/chat_task.ts";
import { OpenAiRefusal } from "./errors.ts";

/** A Chat Completions request as a chat run. */
export interface ChatRequest {
  input: ChatInput;
  stream: boolean;
  /** `stream_options.include_usage`: a usage chunk before `[DONE]`. */
  includeUsage: boolean;
  /** What the run's fingerprint covers: the body without how the answer is delivered (`stream`, ...). */
  fingerprint: Record<string, unknown>;
}

/** A Responses request as a chat run. */
export interface ResponsesRequest {
  input: ChatInput;
  background: boolean;
  instructions?: string;
  metadata?: Record<string, string>;
  fingerprint: Record<string, unknown>;
}

type Body = Record<string, unknown>;

const refuse = (param: string, message: string) => new OpenAiRefusal(422, message, { param });

/** The fields supported features do not use, with why they are refused. */
const UNSUPPORTED: Record<string, string> = {
  tools: "tools are not supported",
  tool_choice: "tools are not supported",
  functions: "functions are not supported",
  function_call: "functions are not supported",
  parallel_tool_calls: "tools are not supported",
  audio: "audio is not supported",
  modalities: "only text is supported",
  top_logprobs: "logprobs are not supported",
  prediction: "predicted outputs are not supported",
};

function object(value: unknown, param: string): Body {
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw refuse(param, `${param} must be an object`);
  }
  return value as Body;
}

function only(body: Body, allowed: readonly string[], where = ""): void {
  for (const key of Object.keys(body)) {
    if (allowed.includes(key)) continue;
    const param = where ? `${where}.${key}` : key;
    throw refuse(param, UNSUPPORTED[key] ? `${param}: ${UNSUPPORTED[key]}` : `${param} is not supported`);
  }
}

function model(body: Body): string {
  if (typeof body.model !== "string" || body.model.length === 0 || body.model.length > 200) {
    throw refuse("model", "model must be a model name");
  }
  return body.model;
}

function outputTokens(value: unknown, param: string): number | undefined {
  if (value === undefined || value === null) return undefined;
  if (!Number.isInteger(value) || (value as number) < 1 || (value as number) > CHAT_MAX_OUTPUT_TOKENS) {
    throw refuse(param, `${param} must be a whole number from 1 to ${CHAT_MAX_OUTPUT_TOKENS}`);
  }
  return value as number;
}

function temperature(value: unknown): number | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== "number" || value < 0 || value > 2) throw refuse("temperature", "temperature must be 0 to 2");
  return value;
}

function metadata(value: unknown): Record<string, string> | undefined {
  if (value === undefined || value === null) return undefined;
  const m = object(value, "metadata");
  const entries = Object.entries(m);
  if (entries.length > 16 || entries.some(([k, v]) => k.length > 64 || typeof v !== "string" || v.length > 512)) {
    throw refuse("metadata", "metadata is at most 16 string values of at most 512 characters, keys of at most 64");
  }
  return m as Record<string, string>;
}

/** A format (`response_format`, or `text.format`) as a chat run's; `named` says whether the schema is nested. */
function format(value: unknown, param: string, nested: boolean): ChatFormat | undefined {
  if (value === undefined || value === null) return undefined;
  const f = object(value, param);
  if (f.type === "json_schema") {
    const spec = nested ? object(f.json_schema, `${param}.json_schema`) : f;
    const parsed = ChatFormat.safeParse({
      type: "json_schema",
      name: spec.name,
      schema: spec.schema,
      strict: spec.strict ?? undefined,
    });
    if (!parsed.success) throw refuse(param, `${param} must name a schema (name, schema, strict)`);
    return parsed.data;
  }
  if (f.type === "text" || f.type === "json_object") return { type: f.type };
  throw refuse(`${param}.type`, `${param}.type must be text, json_object or json_schema`);
}

/** A message's content: a string, or text parts joined; anything else (an image, audio, a file) is refused. */
function content(value: unknown, param: string, textTypes: readonly string[]): string {
  if (typeof value === "string") return value;
  if (!Array.isArray(value)) throw refuse(param, `${param} must be a string or a list of text parts`);
  return value.map((part, i) => {
    const p = object(part, `${param}[${i}]`);
    if (!textTypes.includes(String(p.type)) || typeof p.text !== "string") {
      throw refuse(`${param}[${i}].type`, `${param}[${i}]: only text parts are supported (got ${String(p.type)})`);
    }
    return p.text;
  }).join("");
}

const ROLES: ReadonlySet<string> = new Set(["system", "developer", "user", "assistant"]);

function messages(value: unknown, param: string, textTypes: readonly string[], allowed: readonly string[]) {
  if (!Array.isArray(value) || value.length === 0) throw refuse(param, `${param} must be a non-empty list`);
  return value.map((m, i): ChatMessage => {
    const where = `${param}[${i}]`;
    const message = object(m, where);
    only(message, allowed, where);
    if (!ROLES.has(String(message.role))) {
      throw refuse(`${where}.role`, `${where}.role must be system, developer, user or assistant`);
    }
    return {
      role: message.role as ChatMessage["role"],
      content: content(message.content, `${where}.content`, textTypes),
    };
  });
}

/** Reads a `POST /v1/chat/completions` body. @throws {OpenAiRefusal} 422 naming the field. */
export function readChatRequest(raw: unknown): ChatRequest {
  const body = object(raw, "body");
  only(body, [
    "model",
    "messages",
    "max_completion_tokens",
    "max_tokens",
    "temperature",
    "response_format",
    "stream",
    "stream_options",
    "metadata",
    "user",
    "n",
    "logprobs",
    "store",
  ]);
  if (body.n !== undefined && body.n !== null && body.n !== 1) throw refuse("n", "n must be 1: one choice per request");
  if (body.logprobs !== undefined && body.logprobs !== null && body.logprobs !== false) {
    throw refuse("logprobs", "logprobs are not supported");
  }
  if (body.store !== undefined && body.store !== null && body.store !== false) {
    throw refuse("store", "store is not supported");
  }
  if (body.user !== undefined && typeof body.user !== "string") throw refuse("user", "user must be a string");
  metadata(body.metadata);
  if (body.stream !== undefined && body.stream !== null && typeof body.stream !== "boolean") {
    throw refuse("stream", "stream must be true or false");
  }
  const options = body.stream_options === undefined || body.stream_options === null
    ? {}
    : object(body.stream_options, "stream_options");
  only(options, ["include_usage"], "stream_options");
  const max = outputTokens(body.max_completion_tokens, "max_completion_tokens") ??
    outputTokens(body.max_tokens, "max_tokens");
  const t = temperature(body.temperature);
  const f = format(body.response_format, "response_format", true);
  const input: ChatInput = {
    model: model(body),
    messages: messages(body.messages, "messages", ["text"], ["role", "content", "name"]),
    ...(max === undefined ? {} : { max_output_tokens: max }),
    ...(t === undefined ? {} : { temperature: t }),
    ...(f === undefined ? {} : { format: f }),
  };
  const { stream: _s, stream_options: _o, ...fingerprint } = body;
  return { input, stream: body.stream === true, includeUsage: options.include_usage === true, fingerprint };
}

/** Reads a `POST /v1/responses` body. @throws {OpenAiRefusal} 422 naming the field. */
export function readResponsesRequest(raw: unknown): ResponsesRequest {
  const body = object(raw, "body");
  only(body, [
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "text",
    "metadata",
    "background",
    "store",
    "stream",
  ]);
  if (body.stream !== undefined && body.stream !== null && body.stream !== false) {
    throw refuse(
      "stream",
      "stream is not supported on /v1/responses: use background and retrieve, or chat completions",
    );
  }
  if (body.background !== undefined && body.background !== null && typeof body.background !== "boolean") {
    throw refuse("background", "background must be true or false");
  }
  if (body.instructions !== undefined && body.instructions !== null && typeof body.instructions !== "string") {
    throw refuse("instructions", "instructions must be a string");
  }
  const text = body.text === undefined || body.text === null ? {} : object(body.text, "text");
  only(text, ["format"], "text");
  const instructions = typeof body.instructions === "string" ? body.instructions : undefined;
  const conversation = typeof body.input === "string"
    ? [{ role: "user" as const, content: body.input }]
    : messages(body.input, "input", ["input_text", "output_text", "text"], ["role", "content", "type"]);
  const max = outputTokens(body.max_output_tokens, "max_output_tokens");
  const t = temperature(body.temperature);
  const f = format(text.format, "text.format", false);
  const meta = metadata(body.metadata);
  const input: ChatInput = {
    model: model(body),
    messages: [
      ...(instructions === undefined ? [] : [{ role: "system" as const, content: instructions }]),
      ...conversation,
    ],
    ...(max === undefined ? {} : { max_output_tokens: max }),
    ...(t === undefined ? {} : { temperature: t }),
    ...(f === undefined ? {} : { format: f }),
  };
  const { stream: _s, ...fingerprint } = body;
  return {
    input,
    background: body.background === true,
    ...(instructions === undefined ? {} : { instructions }),
    ...(meta === undefined ? {} : { metadata: meta }),
    fingerprint,
  };
}
