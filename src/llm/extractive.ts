import type { LLM } from "./llm.ts";
import { MAX_OUTPUT_TOKENS, SUMMARY_INSTRUCTION } from "./llm.ts";
import { instanceOf, InstanceTooLarge } from "./schema_instance.ts";

const STOPWORDS = new Set(
  ("a about above after again against all am an and any are as at be because been before being below between both " +
    "but by can could did do does doing down during each few for from further had has have having he her here hers " +
    "him his how i if in into is it its itself just me more most my no nor not now of off on once only or other our " +
    "ours out over own same she should so some such than that the their theirs them then there these they this those " +
    "through to too under until up very was we were what when where which while who whom why will with would you " +
    "your yours also may might must shall said says one two new")
    .split(" "),
);

/** Splits text into sentences, keeping their order. */
export function splitSentences(text: string): string[] {
  return text
    .replace(/\s+/g, " ")
    .split(/(?<=[.!?])\s+(?=[A-Z0-9"'(\[])/)
    .map((s) => s.trim())
    .filter((s) => s.length > 0);
}

function words(sentence: string): string[] {
  return (sentence.toLowerCase().match(/[\p{L}\p{N}][\p{L}\p{N}'-]*/gu) ?? [])
    .filter((w) => w.length > 2 && !STOPWORDS.has(w));
}

/**
 * Picks the most salient sentences: each word scores by its frequency in the
 * document, each sentence by the mean score of its words (so long sentences
 * do not win by length alone), with a small bonus for the opening sentence.
 * The chosen sentences are returned in document order. Deterministic.
 */
export function summariseExtractively(text: string, maxSentences = 3): string {
  const sentences = splitSentences(text);
  if (sentences.length <= maxSentences) return sentences.join(" ");
  const freq = new Map<string, number>();
  for (const s of sentences) for (const w of words(s)) freq.set(w, (freq.get(w) ?? 0) + 1);
  const top = Math.max(1, ...freq.values());
  const scored = sentences.map((s, index) => {
    const ws = words(s);
    const score = ws.length ? ws.reduce((sum, w) => sum + freq.get(w)! / top, 0) / Math.sqrt(ws.length) : 0;
    return { index, score: score * (index === 0 ? 1.15 : 1) };
  });
  const keep = Math.min(maxSentences, Math.max(1, Math.ceil(sentences.length / 5)));
  return scored
    .sort((a, b) => b.score - a.score || a.index - b.index)
    .slice(0, keep)
    .sort((a, b) => a.index - b.index)
    .map(({ index }) => sentences[index])
    .join(" ");
}

/**
 * The embedded default model: a local, deterministic extractive summariser,
 * so the service runs with no API key and no network. Asked for structured
 * output, it answers a value valid against the schema whose strings are the
 * extractive summary (a stand-in that lets a task with an output schema run
 * end to end in `deno task dev`; a real model decides the values).
 */
export function createExtractiveLlm(): LLM {
  return {
    // deno-lint-ignore require-await
    async complete(prompt, { signal, jsonSchema, maxOutputTokens = MAX_OUTPUT_TOKENS }) {
      signal.throwIfAborted();
      const text = prompt.startsWith(SUMMARY_INSTRUCTION) ? prompt.slice(SUMMARY_INSTRUCTION.length) : prompt;
      const summary = summariseExtractively(text.trim());
      if (!jsonSchema) return { text: summary };
      // As a model's answer, at most its output cap (about 4 characters a token): a tenant's schema whose
      // instance is larger fails the run at once (InstanceTooLarge, a bug of the definition, not retried)
      // instead of building millions of nodes on the worker's thread.
      const chars = maxOutputTokens * 4;
      const bounds = { maxChars: chars, maxNodes: chars };
      try {
        return { text: JSON.stringify(instanceOf(jsonSchema.schema, summary, bounds)) };
      } catch (error) {
        if (!(error instanceof InstanceTooLarge)) throw error;
        // The summary may be what does not fit: the smallest strings, then.
        return { text: JSON.stringify(instanceOf(jsonSchema.schema, "", bounds)) };
      }
    },
  };
}
