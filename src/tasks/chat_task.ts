/**
 * The built-in `chat` task (version 1): what the OpenAI-compatible endpoints run (`src/openai_compat/`). Its
 * input is the request's own conversation, model and output format, and its call sends them as they are: no
 * template, no schema of the tenant's. A run of it goes through the same intake, lanes, worker and commit as
 * every run; only the call it makes is built here.
 */
import { z } from "zod";
import type { CallOptions, ChatMessage } from "../llm/llm.ts";
import { MAX_OUTPUT_TOKENS } from "../llm/llm.ts";
import type { TaskDefinition } from "./definition.ts";

/** The built-in chat task's name; nobody can PUT it. */
export const CHAT_TASK = "chat";

/** The most output tokens a chat run may ask for (a task's own bound). */
export const CHAT_MAX_OUTPUT_TOKENS = 16_384;

/** The output format a chat run asks for: text, any JSON object, or JSON valid against a schema. */
export const ChatFormat = z.discriminatedUnion("type", [
  z.object({ type: z.literal("text") }),
  z.object({ type: z.literal("json_object") }),
  z.object({
    type: z.literal("json_schema"),
    name: z.string().min(1).max(64),
    schema: z.record(z.string(), z.unknown()),
    strict: z.boolean().optional(),
  }),
]);
export type ChatFormat = z.infer<typeof ChatFormat>;

/** A chat run's input: the conversation as given, the model asked for, and how to answer. */
export const ChatInput = z.object({
  model: z.string().min(1),
  messages: z.array(z.object({
    role: z.enum(["system", "developer", "user", "assistant"]),
    content: z.string(),
  })).min(1),
  max_output_tokens: z.number().int().min(1).max(CHAT_MAX_OUTPUT_TOKENS).optional(),
  temperature: z.number().min(0).max(2).optional(),
  format: ChatFormat.optional(),
});
export type ChatInput = z.infer<typeof ChatInput>;

/**
 * The chat task's definition as the worker and the result cache see it. Its prompt names the messages only so
 * that the render limit (`RENDER_LIMITS`) measures them; the call is built by {@linkcode chatCall}.
 */
export const CHAT_DEFINITION: TaskDefinition = {
  prompt: "{{input.messages}}",
  input_schema: {
    type: "object",
    properties: { model: { type: "string" }, messages: { type: "array" } },
    required: ["model", "messages"],
  },
  max_output_tokens: MAX_OUTPUT_TOKENS,
};

/** The text of a conversation, every message's content in order: what its token estimate is made of. */
export function conversationText(messages: readonly ChatMessage[]): string {
  return messages.map((m) => m.content).join("\n\n");
}

/**
 * A chat run's model call: its messages as given, its one model, its output cap, temperature and format. The
 * prompt is the conversation's text (the estimate, the budget's worst case, and the embedded model read it).
 * @throws {z.ZodError} when the input is not a chat input (a malformed message).
 */
export function chatCall(input: unknown): {
  prompt: string;
  models: readonly string[];
  options: Omit<CallOptions, "signal" | "model">;
} {
  const chat = ChatInput.parse(input);
  const format = chat.format;
  return {
    prompt: conversationText(chat.messages),
    models: [chat.model],
    options: {
      messages: chat.messages,
      maxOutputTokens: chat.max_output_tokens ?? MAX_OUTPUT_TOKENS,
      ...(chat.temperature === undefined ? {} : { temperature: chat.temperature }),
      ...(format?.type === "json_object" ? { jsonObject: true } : {}),
      ...(format?.type === "json_schema"
        ? {
          jsonSchema: {
            name: format.name,
            schema: format.schema,
            ...(format.strict === undefined ? {} : { strict: format.strict }),
          },
        }
        : {}),
    },
  };
}
