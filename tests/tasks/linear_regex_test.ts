/**
 * Tenants' regular expressions run on RE2 with their ECMAScript meaning
 * (`src/tasks/linear_regex.ts`): the same answers as V8 on a corpus, what RE2
 * cannot express refused with the reason, the shape check that refuses two
 * unbounded repetitions that can match the same character one after the
 * other, and patterns that V8 would backtrack on for ever answering at once
 * through the schema validator, `patternProperties` and `format: "url"`
 * included.
 */
import assert from "node:assert/strict";
import { compileLinearRegex, RegexRefused } from "../../src/tasks/linear_regex.ts";
import { compileSchema, SchemaRefused } from "../../src/tasks/json_schema.ts";
import { seededRandom } from "../_support.ts";

/** Ten `\d*` then an `x`: on a run of digits without the `x`, V8 backtracks through every split of the run. */
const HOSTILE = `^${"\\d*".repeat(10)}x`;
/**
 * Ten `\d+` with a `.` between each two: the shape check accepts it (something must match between them), yet
 * `.` matches a digit too, so on a run of digits V8 tries every placement of the nine dots.
 */
const SEPARATED = `^${Array(10).fill("\\d+").join(".")}x$`;
const DIGITS = "1".repeat(200);

Deno.test("the shape check refuses two unbounded repetitions that can match the same character one after the other", () => {
  for (
    const pattern of [
      "^\\d*\\d*x",
      HOSTILE,
      "^\\d+\\d+\\d+$",
      "^\\w+\\s?\\w+$",
      "(\\d+)(\\d+)",
      "a*(?:b|a*)",
      "^[a-z]*[^A-Z]+$",
      "\\p{L}+\\p{Lu}+",
      "\\d+\\b\\d+",
    ]
  ) {
    assert.throws(() => compileLinearRegex(pattern), (error: unknown) => {
      assert.ok(error instanceof RegexRefused, `${pattern}: ${error}`);
      assert.match(error.message, /can match the same character one after the other/, pattern);
      return true;
    });
  }
  // Ordinary patterns pass: what lies between two repetitions must match first, or they share no character.
  for (
    const pattern of [
      "^[a-z]+-\\d+$",
      "^\\S+@\\S+$",
      "^[a-z0-9._-]+@[a-z0-9.-]+$",
      "^[A-Z]{2}\\d{6}$",
      "[0-9]+[a-f]*",
      "\\p{Lu}+\\d+",
      "^\\+?[0-9 ]+$",
      "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
      SEPARATED,
    ]
  ) {
    compileLinearRegex(pattern);
  }
  // The rules that were there before stay: nesting, repeated alternation, at most ten repetitions.
  for (const pattern of ["^(a+)+$", "^(a|a)*$", "^(a|aa)+$", "(?:ab?)+", "a{1,9}".repeat(11)]) {
    assert.throws(() => compileLinearRegex(pattern), /unbounded time/, pattern);
  }
});

Deno.test("what RE2 cannot express is refused with the reason, for a new expression and a stored one", () => {
  const cases: [string, RegExp][] = [
    ["^(?=\\d)\\d+$", /look-around/],
    ["(?<!a)b", /look-around/],
    ["(x)\\1", /back-reference/],
    ["(?<n>x)\\k<n>", /back-reference/],
    ["(?i:abc)", /inline modifier/],
    ["\\p{Alphabetic}", /not a property RE2 has/],
    ["a{1001}", /at most 1000 times/],
    ["(", /not a valid regular expression/],
  ];
  for (const [pattern, reason] of cases) {
    for (const strict of [true, false]) {
      assert.throws(() => compileLinearRegex(pattern, { strict }), (error: unknown) => {
        assert.ok(error instanceof RegexRefused, `${pattern}: ${error}`);
        assert.match(error.message, reason, pattern);
        return true;
      });
    }
  }
  // Too large for a new expression; a stored one runs (its cost per character is in the validation's estimate).
  assert.throws(() => compileLinearRegex(".{0,1000}".repeat(3)), /size 3003 as RE2 compiles it; at most 2000/);
  assert.ok(compileLinearRegex(".{0,1000}".repeat(3), { strict: false }).test("x".repeat(3000)));
});

Deno.test("RE2 answers as V8 does, with ECMAScript's \\s, dot, \\u escapes, classes and properties", () => {
  const patterns = [
    "^[a-z]+-\\d+$",
    "^\\S+@\\S+$",
    "a.c",
    "^\\s*$",
    "\\bfoo\\b",
    "^[^]$",
    "^[]$",
    "x[^\\s\\d]y",
    "[\\S]",
    "\\u0041\\u{1F600}",
    "\\uD83D\\uDE00",
    "^[\\u0000-\\u007f]*$",
    "\\p{Lu}",
    "\\P{L}",
    "[\\p{L}\\d]",
    "\\p{Script=Greek}",
    "\\p{Letter}",
    "^(?<n>ab)c$",
    "\\cJ",
    "\\0",
    "\\x41",
    "[\\b]",
    "a{2,3}",
    "a{2,}?",
    "(?:ab|cd)e",
    "^$",
    "\\/",
    "[\\-a]",
    "[a-]",
    "[-a]",
    "\\.",
    "\\p{ASCII}",
    "^.$",
    "[\\w-]",
    "\\W",
    "\\D",
    "é+",
    "[😀-🙏]",
    "^(a|)$",
  ];
  const alphabet = [..."abcA1 \n\r\u2028\u00a0\ufeffé😀Ω-_@.\b\0/xyedfoJ"];
  const random = seededRandom(37);
  let compared = 0;
  for (const pattern of patterns) {
    const linear = compileLinearRegex(pattern, { strict: false });
    const v8 = new RegExp(pattern, "u");
    for (let i = 0; i < 2_000; i++) {
      const text = Array.from({ length: Math.floor(random() * 6) }, () => alphabet[Math.floor(random() * 29)]).join("");
      assert.equal(linear.test(text), v8.test(text), `${pattern} on ${JSON.stringify(text)}`);
      compared++;
    }
  }
  assert.equal(compared, patterns.length * 2_000);
});

Deno.test("patterns V8 backtracks on for ever validate at once: pattern, patternProperties, a stored schema", () => {
  // A schema stored before the shape check existed may hold HOSTILE; a new one is refused, naming the place.
  assert.throws(() => compileSchema({ type: "string", pattern: HOSTILE }), (error: unknown) => {
    assert.ok(error instanceof SchemaRefused);
    assert.equal(error.pointer, "/pattern");
    return true;
  });
  const cases: [unknown, unknown, string][] = [
    [{ type: "string", pattern: HOSTILE }, DIGITS, ""],
    [{ type: "string", pattern: SEPARATED }, DIGITS, ""],
    [{ type: "object", patternProperties: { [HOSTILE]: { type: "string" } } }, { [`${DIGITS}x`]: 1 }, `/${DIGITS}x`],
    [{ type: "object", patternProperties: { [SEPARATED]: false } }, { [DIGITS]: 1, [`${DIGITS}x`]: 2 }, `/${DIGITS}x`],
  ];
  for (const [schema, instance, pointer] of cases) {
    const compiled = compileSchema(schema, { stored: true });
    const started = performance.now();
    const violations = compiled.validate(instance);
    // Not a speed check: on V8 none of these would return (HOSTILE took 2.7 s on 30 digits, SEPARATED 4.3 s on 50).
    assert.ok(performance.now() - started < 1_000);
    assert.equal(violations[0]?.pointer, pointer, JSON.stringify(violations));
  }
  // `RegExp` is V8's own again once a validation is over.
  assert.ok(/^a+$/u instanceof RegExp && new RegExp("^a+$", "u").test("aaa"));
  // patternProperties still decides what additionalProperties sees.
  const mixed = compileSchema({
    type: "object",
    patternProperties: { "^[a-z]+-\\d+$": { type: "integer" } },
    additionalProperties: false,
  });
  assert.deepEqual(mixed.validate({ "ab-1": 1 }), []);
  assert.equal(mixed.validate({ "ab-1": "x" })[0]?.pointer, "/ab-1");
  assert.equal(mixed.validate({ "AB-1": 1 })[0]?.pointer, "/AB-1");
});

/** `url` as `@cfworker/json-schema` 4.1.6 writes it (dist/esm/format.js): the meaning RE2's version must keep. */
const LIBRARY_URL =
  /^(?:(?:https?|ftp):\/\/)(?:\S+(?::\S*)?@)?(?:(?!10(?:\.\d{1,3}){3})(?!127(?:\.\d{1,3}){3})(?!169\.254(?:\.\d{1,3}){2})(?!192\.168(?:\.\d{1,3}){2})(?!172\.(?:1[6-9]|2\d|3[0-1])(?:\.\d{1,3}){2})(?:[1-9]\d?|1\d\d|2[01]\d|22[0-3])(?:\.(?:1?\d{1,2}|2[0-4]\d|25[0-5])){2}(?:\.(?:[1-9]\d?|1\d\d|2[0-4]\d|25[0-4]))|(?:(?:[a-z\u{00a1}-\u{ffff}0-9]+-?)*[a-z\u{00a1}-\u{ffff}0-9]+)(?:\.(?:[a-z\u{00a1}-\u{ffff}0-9]+-?)*[a-z\u{00a1}-\u{ffff}0-9]+)*(?:\.(?:[a-z\u{00a1}-\u{ffff}]{2,})))(?::\d{2,5})?(?:\/[^\s]*)?$/iu;

Deno.test("format url runs on RE2 with the library's meaning, and a hostile one answers at once", () => {
  const url = compileSchema({ type: "string", format: "url" });
  const random = seededRandom(7);
  const pick = <T>(list: T[]) => list[Math.floor(random() * list.length)]!;
  const octets = ["0", "1", "9", "10", "16", "31", "32", "99", "100", "127", "168", "169", "172", "192", "223", "224"];
  octets.push("254", "255", "256", "01", "016", "00");
  const schemes = ["http://", "https://", "HTTP://", "ftp://", "Ftp://", "httpſ://", "ftps://", "htp://", ""];
  const users = ["", "", "u@", "u:p@", "10.0.0.1@", "a@b@", " x@", ":@"];
  const labels = ["a", "ab", "a-b", "a--b", "-a", "a-", "é", "xn--ab", "A", "K", "ſ", "😀", "1", "co", "c", "Z1"];
  const tails = ["", "", ":80", ":8", ":123456", "/", "/a b", "/x?y#z", "?q", ":80/p"];
  let valid = 0;
  for (let i = 0; i < 50_000; i++) {
    const host = random() < 0.5
      ? Array.from({ length: 2 + Math.floor(random() * 3) }, () => pick(octets)).join(".")
      : Array.from({ length: 1 + Math.floor(random() * 4) }, () => pick(labels) + pick(["", "", pick(labels)])).join(
        ".",
      );
    const text = pick(schemes) + pick(users) + host + pick(tails);
    const want = LIBRARY_URL.test(text);
    assert.equal(url.validate(text).length === 0, want, JSON.stringify(text));
    if (want) valid++;
  }
  assert.ok(valid > 1_000, `${valid} of the generated URLs are valid`);
  // On V8 each two more letters took four times as long: 32 took 85 ms, 100,000 would never end.
  const started = performance.now();
  assert.equal(url.validate(`http://${"a".repeat(100_000)}_`).length, 1);
  assert.ok(performance.now() - started < 1_000);
});

Deno.test("a new schema holds at most 32 regular expressions, of sizes adding up to 2,500; a stored one any", () => {
  const many = {
    type: "object",
    properties: Object.fromEntries(
      Array.from({ length: 33 }, (_, i) => [`p${i}`, { type: "string", pattern: `^a${i}$` }]),
    ),
  };
  assert.throws(() => compileSchema(many), (error: unknown) => {
    assert.ok(error instanceof SchemaRefused);
    assert.equal(error.pointer, "/properties/p32/pattern");
    assert.match(error.message, /more than 32 distinct regular expressions/);
    return true;
  });
  const large = { type: "object", patternProperties: { "^a.{0,999}$": {}, "^b.{0,999}$": {}, "^c.{0,999}$": {} } };
  assert.throws(
    () => compileSchema(large),
    /\/patternProperties\/\^c\.\{0,999\}\$: regular expressions of more than 2500/,
  );
  for (const schema of [many, large]) assert.deepEqual(compileSchema(schema, { stored: true }).validate({}), []);
});

Deno.test("the shape check's probing of classes against \\p{...} sets is bounded per pattern", () => {
  // 80 classes then 85 \p{Zl}, each group repeated: 80 × 85 pairs, each probed up to 1,024 characters (about
  // 220 ms a pattern before the budget; a schema could hold 14 of them, and a check Worker that runs over its
  // deadline is not stopped by terminate()).
  const pattern = `(?:${"[\\0-\u03ff]".repeat(80)})*(?:${"\\p{Zl}".repeat(85)})*`;
  const started = performance.now();
  assert.throws(() => compileLinearRegex(pattern), RegexRefused);
  const took = performance.now() - started;
  assert.ok(took < 100, `refused after ${took.toFixed(0)} ms`);
});
