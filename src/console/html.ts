/**
 * HTML built only through the `html` tag: every interpolated value is
 * escaped unless it is itself `html` (or `raw`, for markup this code wrote).
 * Summaries, documents, tenant names and error bodies are untrusted.
 */

/** Markup that is already safe. */
export class Html {
  constructor(readonly text: string) {}
  toString(): string {
    return this.text;
  }
}

const ESCAPES: Record<string, string> = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

/** Escapes text for an HTML element or a quoted attribute. */
export function escapeHtml(value: unknown): string {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ESCAPES[c]!);
}

type Part = Html | string | number | boolean | null | undefined | Part[];

function render(part: Part): string {
  if (part instanceof Html) return part.text;
  if (Array.isArray(part)) return part.map(render).join("");
  if (part === null || part === undefined || part === false) return "";
  return escapeHtml(part);
}

/** The tag: `html\`<td>${untrusted}</td>\``. Arrays are joined; null, undefined and false render nothing. */
export function html(strings: TemplateStringsArray, ...values: Part[]): Html {
  let out = strings[0]!;
  values.forEach((value, i) => (out += render(value) + strings[i + 1]!));
  return new Html(out);
}

/** Markup written by this code, never from data. */
export function raw(markup: string): Html {
  return new Html(markup);
}
