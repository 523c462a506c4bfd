/**
 * A provider that limits tokens per minute the way OpenAI does, for the
 * fair-share tests and the token-share bench: a budget of `tpm` tokens (and
 * `rpm` requests) that refills continuously, advertised on every answer in
 * `x-ratelimit-*` headers, and refused above it with `429
 * rate_limit_exceeded`, `retry-after-ms` and OpenAI's message. A call costs
 * the tokens its answer reports in `usage`: the prompt at four characters a
 * token, and the summary the same way. (It belongs beside `limitedProvider`
 * in `tests/support/fake_model_server.ts`.)
 */
import { summariseExtractively } from "../../src/llm/extractive.ts";
import { SUMMARY_INSTRUCTION } from "../../src/llm/llm.ts";
import { errorBody, type ModelBehaviour } from "../support/fake_model_server.ts";

/** A {@linkcode tokenLimitedProvider}: `respond` for `startFakeModel`, and what it answered. */
export interface TokenLimitedProvider {
  respond(n: number, prompt: string): ModelBehaviour;
  readonly counts: { ok: number; rateLimited: number; tokens: number };
}

/** How many tokens the fake provider counts for `text`. */
export function fakeTokens(text: string): number {
  return Math.ceil(text.length / 4);
}

/** A document of about `tokens` tokens as {@linkcode fakeTokens} counts them, distinct per `seed`. */
export function documentOf(tokens: number, seed: string): string {
  const sentences = [
    `Account ${seed} renewed its contract for another year.`,
    "Revenue rose 12% in the quarter thanks to enterprise revenue.",
    "Costs fell after the move to the new data centre.",
    "The board approved the expansion plan for next year.",
    "Support tickets dropped by a third once the new portal shipped.",
  ];
  let text = "";
  for (let i = 0; fakeTokens(text) < tokens; i++) text += sentences[i % sentences.length] + " ";
  return text.trim();
}

function resetText(ms: number): string {
  if (ms < 1000) return `${Math.max(1, Math.ceil(ms))}ms`;
  const s = ms / 1000;
  return s < 60 ? `${s.toFixed(3).replace(/\.?0+$/, "")}s` : `${Math.floor(s / 60)}m${Math.round(s % 60)}s`;
}

/** A provider allowing `tpm` tokens and `rpm` requests per minute, answering after `delayMs`. */
export function tokenLimitedProvider(
  { tpm, rpm = 500, delayMs = 20 }: { tpm: number; rpm?: number; delayMs?: number },
): TokenLimitedProvider {
  const counts = { ok: 0, rateLimited: 0, tokens: 0 };
  // Both budgets start full and refill continuously up to one minute's worth, as OpenAI's do.
  let tokens = tpm;
  let requests = rpm;
  let at = performance.now();
  const refill = (now: number) => {
    tokens = Math.min(tpm, tokens + ((now - at) / 60_000) * tpm);
    requests = Math.min(rpm, requests + ((now - at) / 60_000) * rpm);
    at = now;
  };
  const headers = () => ({
    "x-ratelimit-limit-requests": String(rpm),
    "x-ratelimit-remaining-requests": String(Math.floor(requests)),
    "x-ratelimit-reset-requests": resetText(((rpm - requests) / rpm) * 60_000),
    "x-ratelimit-limit-tokens": String(tpm),
    "x-ratelimit-remaining-tokens": String(Math.floor(tokens)),
    "x-ratelimit-reset-tokens": resetText(((tpm - tokens) / tpm) * 60_000),
  });
  return {
    counts,
    respond(_n, prompt) {
      refill(performance.now());
      const text = prompt.startsWith(SUMMARY_INSTRUCTION) ? prompt.slice(SUMMARY_INSTRUCTION.length).trim() : prompt;
      const usage = {
        prompt_tokens: fakeTokens(prompt),
        completion_tokens: fakeTokens(summariseExtractively(text) || "(empty)"),
      };
      const cost = usage.prompt_tokens + usage.completion_tokens;
      if (requests < 1 || tokens < cost) {
        counts.rateLimited++;
        const waitMs = Math.max(((1 - requests) / rpm) * 60_000, ((cost - tokens) / tpm) * 60_000, 1);
        const which = tokens < cost ? "tokens per min (TPM)" : "requests per min (RPM)";
        return {
          kind: "status",
          status: 429,
          headers: { ...headers(), "retry-after-ms": String(Math.ceil(waitMs)) },
          body: errorBody(
            `Rate limit reached on ${which}: Limit ${tokens < cost ? tpm : rpm}, Requested ${cost}. ` +
              `Please try again in ${Math.ceil(waitMs)}ms.`,
            tokens < cost ? "tokens" : "requests",
            "rate_limit_exceeded",
          ),
        };
      }
      tokens -= cost;
      requests -= 1;
      counts.ok++;
      counts.tokens += cost;
      return { kind: "ok", delayMs, usage, headers: headers() };
    },
  };
}
