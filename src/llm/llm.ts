/** A text-completion model. */
export interface LLM {
  /** Completes `prompt`. Honours `signal`: an aborted call must stop paying. */
  complete(prompt: string, options: { signal: AbortSignal }): Promise<string>;
}

/** The instruction that precedes the document text (which is passed verbatim). */
export const SUMMARY_INSTRUCTION = "Summarise the following document for the account team in a few sentences.";

/** The prompt for a document: the instruction, then the text verbatim. */
export function summaryPrompt(text: string): string {
  return `${SUMMARY_INSTRUCTION}\n\n${text}`;
}
