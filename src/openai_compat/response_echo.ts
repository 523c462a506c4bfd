/**
 * What a Responses create carried that its `response` object echoes and the model does not read: `background`,
 * `instructions` and `metadata`. The run keeps them in its own input, under `response`, so they are stored with
 * the run and for as long as it is: `GET /v1/responses/{id}` reads them back from the committed run
 * (`run_results.input`).
 *
 * The run's fingerprint is not made from this input but from the request body as sent (`readResponsesRequest`),
 * which already covered all three: a key's run id, its replays and its `422` for another body are as they were.
 * A request that carries none of them keeps the input it always had (no `response`), so its result-cache entry and
 * its stored input do not change either.
 */
import type { Sql } from "postgres";
import { decidedRun } from "../jobs/job_store.ts";
import type { ChatInput } from "../tasks/chat_task.ts";
import type { ResponsesRequest } from "./requests.ts";

/** What a response object echoes of the request that created it. */
export interface ResponseEcho {
  background: boolean;
  instructions: string | null;
  metadata: Record<string, string>;
}

/** OpenAI's values for a request that set none of them; also what a response whose create is unknown shows. */
export const NO_ECHO: ResponseEcho = { background: false, instructions: null, metadata: {} };

/** What `request` makes its response object echo. */
export function echoOf(request: ResponsesRequest): ResponseEcho {
  return {
    background: request.background,
    instructions: request.instructions ?? null,
    metadata: request.metadata ?? {},
  };
}

/**
 * The echo as the run's input keeps it: only what differs from {@linkcode NO_ECHO}. The instructions are not
 * copied: `readResponsesRequest` made them the input's first message (a system message), and `instructions_first`
 * says that this message is them, not one of the request's own `input`.
 */
interface StoredEcho {
  background?: true;
  instructions_first?: true;
  metadata?: Record<string, string>;
}

/** A chat run's input that also keeps a Responses create's echo (the model call reads only the {@linkcode ChatInput}). */
export type EchoingInput = ChatInput & { response?: StoredEcho };

/** `input` with what its response object must echo; `input` itself when that is all defaults. */
export function withEcho(input: ChatInput, echo: ResponseEcho): EchoingInput {
  const stored: StoredEcho = {
    ...(echo.background ? { background: true as const } : {}),
    ...(echo.instructions === null ? {} : { instructions_first: true as const }),
    ...(Object.keys(echo.metadata).length > 0 ? { metadata: echo.metadata } : {}),
  };
  return Object.keys(stored).length > 0 ? { ...input, response: stored } : input;
}

const isObject = (value: unknown): value is Record<string, unknown> =>
  typeof value === "object" && value !== null && !Array.isArray(value);

/**
 * The echo a run's input kept ({@linkcode withEcho}); {@linkcode NO_ECHO}'s values for what it did not keep (a run
 * accepted by a release before the echo was kept has none).
 */
export function echoOfInput(input: unknown): ResponseEcho {
  const stored = isObject(input) && isObject(input.response) ? input.response : {};
  const first = isObject(input) && Array.isArray(input.messages) ? input.messages[0] : undefined;
  const instructions = stored.instructions_first === true && isObject(first) && typeof first.content === "string"
    ? first.content
    : null;
  const metadata = isObject(stored.metadata) &&
      Object.values(stored.metadata).every((value) => typeof value === "string")
    ? stored.metadata as Record<string, string>
    : {};
  return { background: stored.background === true, instructions, metadata };
}

/**
 * The echo of a done run, read from its committed input (`run_results`). A run that is not done has no committed
 * input (its input is in its lane's stream message only): {@linkcode NO_ECHO}.
 */
export async function storedEcho(sql: Sql, runId: string): Promise<ResponseEcho> {
  const decided = await decidedRun(sql, runId);
  return decided?.outcome === "done" ? echoOfInput(decided.input) : NO_ECHO;
}
