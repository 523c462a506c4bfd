/**
 * The Web Worker that checks task definitions for `definition_checker.ts`:
 * it compiles their schemas and checks their templates away from the thread
 * that serves requests, which enforces the deadline and terminates this
 * Worker when a check runs over. It says `ready` once loaded, so that its
 * loading does not count against the first check's deadline.
 */
import { type CheckableDefinition, checkDefinition, DefinitionRefused } from "./definition_check.ts";

/** One definition to check, as JSON text (a string crosses the channel as one copy). */
export interface CheckMessage {
  id: number;
  json: string;
}

/** The Worker's answers. */
export type CheckReply =
  | { type: "ready" }
  | { type: "passed"; id: number }
  | { type: "refused"; id: number; pointer: string; message: string }
  | { type: "failed"; id: number; name: string; message: string };

interface WorkerScope {
  onmessage: ((event: MessageEvent<CheckMessage>) => void) | null;
  postMessage(message: CheckReply): void;
}

const scope = globalThis as unknown as WorkerScope;

scope.onmessage = ({ data: { id, json } }) => {
  try {
    checkDefinition(JSON.parse(json) as CheckableDefinition);
    scope.postMessage({ type: "passed", id });
  } catch (error) {
    if (error instanceof DefinitionRefused) {
      scope.postMessage({ type: "refused", id, pointer: error.pointer, message: error.message });
      return;
    }
    const { name, message } = error instanceof Error ? error : new Error(String(error));
    scope.postMessage({ type: "failed", id, name, message });
  }
};

scope.postMessage({ type: "ready" });
