import assert from "node:assert/strict";
import { printRows } from "../../src/cli/table.ts";

Deno.test("CLI tables print a provider's error body without its control characters", () => {
  const lines: string[] = [];
  printRows([{ id: "1", last_error: "http_500: \u001b[2J\u001b[31mpwned\r\nline two\u0007" }], {
    out: (l) => lines.push(l),
  });
  const text = lines.join("\n");
  assert.doesNotMatch(text.replaceAll("\n", ""), /\p{Cc}/u, "no control characters reach the terminal");
  assert.match(text, /\?\[2J\?\[31mpwned\? line two\?/);
  // JSON output escapes them instead.
  const json: string[] = [];
  printRows([{ e: "\u001b" }], { json: true, out: (l) => json.push(l) });
  assert.equal(json[0], '{"e":"\\u001b"}');
});
