/**
 * The Web Worker that checks task definitions for `definition_checker.ts`:
 * it compiles their schemas and checks their templates away from the thread
 * that serves requests, which enforces the deadline and terminates this
 * Worker when a check runs over.
 */
import { type CheckableDefinition, checkDefinition, DefinitionRefused } from "./definition_check.ts";
import { serveWorker } from "./_pool_worker.ts";

/** One definition to check, as JSON text (a string crosses the channel as one copy). */
export interface CheckMessage {
  id: number;
  json: string;
}

/** The Worker's answers. */
export type CheckReply =
  | { type: "passed"; id: number }
  | { type: "refused"; id: number; pointer: string; message: string }
  | { type: "failed"; id: number; name: string; message: string };

serveWorker<CheckMessage>(() => {}, ({ id, json }): CheckReply => {
  try {
    checkDefinition(JSON.parse(json) as CheckableDefinition);
    return { type: "passed", id };
  } catch (error) {
    if (error instanceof DefinitionRefused) {
      return { type: "refused", id, pointer: error.pointer, message: error.message };
    }
    const { name, message } = error instanceof Error ? error : new Error(String(error));
    return { type: "failed", id, name, message };
  }
});
