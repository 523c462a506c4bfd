/**
 * A tenant's regular expression (a JSON Schema `pattern` or `patternProperties`
 * key: ECMA-262 with the `u` flag) run on RE2's linear-time engine (`re2js`,
 * pure JavaScript) instead of V8's backtracking one. In Deno 2.9.6 nothing
 * stops a thread that is busy: not a timer, not `Worker.terminate()`. So a
 * tenant's expression must not be able to run long in the first place.
 *
 * The expression is parsed here, checked, and written out in RE2's syntax with
 * its ECMAScript meaning: every literal as `\x{...}`, `\s` and `.` as the sets
 * ECMAScript gives them (RE2's are narrower), `\u` escapes as code points. What
 * RE2 cannot express (look-arounds, back-references, inline modifiers, most
 * binary `\p{...}` properties) is refused with a reason.
 */
import { RE2Set } from "re2js";

/** Limits on one tenant regular expression. */
export const REGEX_LIMITS = {
  /** Repetitions (`*`, `+`, `?`, `{n,m}`) in one expression, when its shape is checked. */
  maxRepetitions: 10,
  /** Its size as RE2 would compile it (about one unit per character matched; a repetition `{n,m}` counts m times). */
  maxSize: 2_000,
  /**
   * Memory of the lazily built DFA of each expression, in bytes (RE2's estimate; about the heap it takes). Past it
   * the DFA starts again, and if that happens too often the match goes on with RE2's NFA: slower, still linear.
   */
  dfaBytes: 16 * 1024,
} as const;

/** Why an expression was refused (the caller adds where it was). */
export class RegexRefused extends Error {
  constructor(reason: string) {
    super(reason);
    this.name = "RegexRefused";
  }
}

/** A tenant's expression, compiled for RE2. */
export interface LinearRegex {
  /** The expression as the tenant wrote it. */
  readonly source: string;
  /** Whether it matches somewhere in `text`, as `new RegExp(source, "u").test(text)` would answer. */
  test(text: string): boolean;
  /** Its size as RE2 compiles it (see {@linkcode REGEX_LIMITS.maxSize}): what one character of a match costs. */
  readonly size: number;
}

/**
 * Checks and compiles a tenant's expression.
 * `strict`: also refuse what an expression new to this service may not be: larger than `maxSize`, or of a shape
 * that could backtrack in an engine that backtracks (see {@linkcode checkShape}). RE2 needs neither, so an
 * expression stored before these rules is compiled without them.
 * @throws {RegexRefused} with the reason when it is not ECMAScript or RE2 cannot express it, or (with `strict`)
 * it is too large or of a refused shape.
 */
export function compileLinearRegex(source: string, { strict = true }: { strict?: boolean } = {}): LinearRegex {
  try {
    // ECMAScript decides what is valid: the parser below may then assume it. Compiling runs nothing.
    new RegExp(source, "u");
  } catch (error) {
    throw new RegexRefused(`not a valid regular expression: ${(error as Error).message}`);
  }
  const tree = new Parser(source).parse();
  if (strict) checkShape(tree);
  const size = sizeOf(tree);
  if (strict && size > REGEX_LIMITS.maxSize) {
    throw new RegexRefused(
      `a regular expression of size ${size} as RE2 compiles it; at most ${REGEX_LIMITS.maxSize} (a repetition {n,m} ` +
        "counts m times)",
    );
  }
  return compileRe2(source, toRe2(tree), size);
}

/**
 * Compiles an expression already in RE2's syntax (this service's own, not a tenant's).
 * @throws {RegexRefused} when RE2 refuses it.
 */
export function compileRe2(source: string, re2: string, size: number): LinearRegex {
  // A set of one: unlike RE2JS, a set takes a bound on its DFA's memory.
  const set = new RE2Set(RE2Set.UNANCHORED, 0, REGEX_LIMITS.dfaBytes);
  try {
    set.add(re2);
    set.compile();
  } catch (error) {
    throw new RegexRefused(`RE2 cannot run it: ${(error as Error).message}`);
  }
  return { source, size, test: (text) => set.match(text).length > 0 };
}

// --- The expression as a tree --------------------------------------------------------------------------------

/** Code point ranges, inclusive, sorted, not overlapping. */
type Ranges = [number, number][];

/** One character out of a set: how RE2 writes it inside brackets, and its ranges when they are known. */
interface CharSet {
  /** RE2 class items (what goes between `[` and `]`). */
  items: string;
  negated: boolean;
  /** Every code point it matches; undefined when a `\p{...}` is in it. */
  ranges?: Ranges;
  /** The ECMAScript source of the atom, to test characters against when `ranges` is unknown. */
  es: string;
}

type Node =
  | { type: "seq"; items: Node[] }
  | { type: "alt"; options: Node[] }
  | { type: "group"; body: Node }
  | { type: "repeat"; body: Node; min: number; max: number; lazy: boolean; source: string }
  | { type: "assert"; re2: string }
  | { type: "char"; set: CharSet; source: string };

const MAX_CODE_POINT = 0x10ffff;

/** ECMAScript's WhiteSpace and LineTerminator: what `\s` matches (RE2's `\s` is ASCII only). */
const WHITE_SPACE: Ranges = [
  [0x09, 0x0d],
  [0x20, 0x20],
  [0xa0, 0xa0],
  [0x1680, 0x1680],
  [0x2000, 0x200a],
  [0x2028, 0x2029],
  [0x202f, 0x202f],
  [0x205f, 0x205f],
  [0x3000, 0x3000],
  [0xfeff, 0xfeff],
];
const DIGITS: Ranges = [[0x30, 0x39]];
const WORD: Ranges = [[0x30, 0x39], [0x41, 0x5a], [0x5f, 0x5f], [0x61, 0x7a]];
/** What `.` matches without the `s` flag: anything but a LineTerminator. */
const DOT: Ranges = complement([[0x0a, 0x0a], [0x0d, 0x0d], [0x2028, 0x2029]]);

/** General categories by ECMAScript's long names, as RE2 writes them. */
const CATEGORIES: Record<string, string> = {
  Cased_Letter: "LC",
  Close_Punctuation: "Pe",
  Connector_Punctuation: "Pc",
  Control: "Cc",
  cntrl: "Cc",
  Currency_Symbol: "Sc",
  Dash_Punctuation: "Pd",
  Decimal_Number: "Nd",
  digit: "Nd",
  Enclosing_Mark: "Me",
  Final_Punctuation: "Pf",
  Format: "Cf",
  Initial_Punctuation: "Pi",
  Letter: "L",
  Letter_Number: "Nl",
  Line_Separator: "Zl",
  Lowercase_Letter: "Ll",
  Mark: "M",
  Combining_Mark: "M",
  Math_Symbol: "Sm",
  Modifier_Letter: "Lm",
  Modifier_Symbol: "Sk",
  Nonspacing_Mark: "Mn",
  Number: "N",
  Open_Punctuation: "Ps",
  Other: "C",
  Other_Letter: "Lo",
  Other_Number: "No",
  Other_Punctuation: "Po",
  Other_Symbol: "So",
  Paragraph_Separator: "Zp",
  Private_Use: "Co",
  Punctuation: "P",
  punct: "P",
  Separator: "Z",
  Space_Separator: "Zs",
  Spacing_Mark: "Mc",
  Surrogate: "Cs",
  Symbol: "S",
  Titlecase_Letter: "Lt",
  Unassigned: "Cn",
  Uppercase_Letter: "Lu",
};
const SHORT_CATEGORIES = new Set(Object.values(CATEGORIES));

/** Characters that are syntax in ECMAScript patterns. */
const SYNTAX = new Set("^$\\.*+?()[]{}|/".split("").map((c) => c.codePointAt(0)!));

/**
 * A parser of ECMAScript patterns with the `u` flag, for patterns `new RegExp(source, "u")` accepted: it trusts
 * the syntax and keeps what RE2 needs.
 */
class Parser {
  readonly #cps: number[];
  #at = 0;

  constructor(readonly source: string) {
    this.#cps = Array.from(source, (c) => c.codePointAt(0)!);
  }

  parse(): Node {
    const tree = this.#disjunction();
    if (this.#at < this.#cps.length) throw new RegexRefused(`cannot read it past position ${this.#at}`);
    return tree;
  }

  #peek(offset = 0): string | undefined {
    const cp = this.#cps[this.#at + offset];
    return cp === undefined ? undefined : String.fromCodePoint(cp);
  }

  #eat(text: string): boolean {
    const cps = Array.from(text, (c) => c.codePointAt(0)!);
    if (cps.some((cp, i) => this.#cps[this.#at + i] !== cp)) return false;
    this.#at += cps.length;
    return true;
  }

  #text(from: number): string {
    return String.fromCodePoint(...this.#cps.slice(from, this.#at));
  }

  #disjunction(): Node {
    const options = [this.#alternative()];
    while (this.#eat("|")) options.push(this.#alternative());
    return options.length === 1 ? options[0]! : { type: "alt", options };
  }

  #alternative(): Node {
    const items: Node[] = [];
    while (this.#at < this.#cps.length && this.#peek() !== "|" && this.#peek() !== ")") {
      const from = this.#at;
      const atom = this.#term();
      items.push(this.#quantified(atom, from));
    }
    return { type: "seq", items };
  }

  #quantified(atom: Node, from: number): Node {
    let min: number, max: number;
    if (this.#eat("*")) [min, max] = [0, Infinity];
    else if (this.#eat("+")) [min, max] = [1, Infinity];
    else if (this.#eat("?")) [min, max] = [0, 1];
    else if (this.#peek() === "{") {
      this.#eat("{");
      min = this.#number();
      max = this.#eat(",") ? (this.#peek() === "}" ? Infinity : this.#number()) : min;
      this.#eat("}");
    } else return atom;
    const lazy = this.#eat("?");
    return { type: "repeat", body: atom, min, max, lazy, source: this.#text(from) };
  }

  #number(): number {
    const from = this.#at;
    while (/[0-9]/.test(this.#peek() ?? "")) this.#at++;
    return Number(this.#text(from));
  }

  #term(): Node {
    const from = this.#at;
    const c = this.#peek()!;
    if (c === "^" || c === "$") {
      this.#at++;
      return { type: "assert", re2: c };
    }
    if (c === "(") return this.#group();
    if (c === ".") {
      this.#at++;
      return { type: "char", set: { items: itemsOf(DOT), negated: false, ranges: DOT, es: "." }, source: "." };
    }
    if (c === "[") return { type: "char", set: this.#class(), source: this.#text(from) };
    if (c === "\\") {
      const next = this.#peek(1);
      if (next === "b" || next === "B") {
        this.#at += 2;
        return { type: "assert", re2: `\\${next}` };
      }
      if (next !== undefined && /[1-9]/.test(next)) throw new RegexRefused("a back-reference (RE2 has none)");
      if (next === "k") throw new RegexRefused("a back-reference (RE2 has none)");
    }
    return { type: "char", set: this.#classAtom(false), source: this.#text(from) };
  }

  #group(): Node {
    const from = this.#at;
    this.#eat("(");
    if (this.#eat("?")) {
      if (this.#peek() === "=" || this.#peek() === "!" || (this.#peek() === "<" && /[=!]/.test(this.#peek(1) ?? ""))) {
        throw new RegexRefused("a look-around (RE2 has none)");
      }
      if (this.#eat("<")) {
        while (this.#peek() !== ">") this.#at++;
        this.#eat(">");
      } else if (!this.#eat(":")) {
        throw new RegexRefused(`an inline modifier (${this.#text(from)}...): write the cases out instead`);
      }
    }
    const body = this.#disjunction();
    this.#eat(")");
    return { type: "group", body };
  }

  /** A bracketed class, `[` included. */
  #class(): CharSet {
    const from = this.#at;
    this.#eat("[");
    const negated = this.#eat("^");
    const parts: CharSet[] = [];
    while (this.#peek() !== "]") {
      const start = this.#classAtom(true);
      if (this.#peek() === "-" && this.#peek(1) !== "]") {
        this.#eat("-");
        const end = this.#classAtom(true);
        // ECMAScript (with `u`) allows a range only between two single characters.
        const lo = start.ranges![0]![0], hi = end.ranges![0]![0];
        parts.push({ items: itemsOf([[lo, hi]]), negated: false, ranges: [[lo, hi]], es: "" });
      } else parts.push(start);
    }
    this.#eat("]");
    const items = parts.map((p) => (p.negated ? negatedItem(p) : p.items)).join("");
    const known = parts.every((p) => p.ranges);
    const ranges = known ? union(parts.flatMap((p) => p.ranges!)) : undefined;
    return {
      items,
      negated,
      ranges: ranges && (negated ? complement(ranges) : ranges),
      es: this.#text(from),
    };
  }

  /** One character, or an escape for a set of them. */
  #classAtom(inClass: boolean): CharSet {
    const from = this.#at;
    const cp = this.#cps[this.#at]!;
    if (cp !== 0x5c /* \ */) {
      this.#at++;
      return single(cp, this.#text(from));
    }
    this.#at++;
    const e = this.#peek()!;
    this.#at++;
    const known = (ranges: Ranges, negated = false): CharSet => ({
      items: itemsOf(ranges),
      negated,
      ranges: negated ? complement(ranges) : ranges,
      es: this.#text(from),
    });
    switch (e) {
      case "d":
        return known(DIGITS);
      case "D":
        return known(DIGITS, true);
      case "w":
        return known(WORD);
      case "W":
        return known(WORD, true);
      case "s":
        return known(WHITE_SPACE);
      case "S":
        return known(WHITE_SPACE, true);
      case "p":
      case "P":
        return this.#property(e === "P", from);
      case "f":
        return single(0x0c, this.#text(from));
      case "n":
        return single(0x0a, this.#text(from));
      case "r":
        return single(0x0d, this.#text(from));
      case "t":
        return single(0x09, this.#text(from));
      case "v":
        return single(0x0b, this.#text(from));
      case "b":
        // Only in a class, where it is a backspace (outside, `\b` is an assertion, handled before).
        return single(0x08, this.#text(from));
      case "0":
        return single(0, this.#text(from));
      case "c":
        this.#at++;
        return single(this.#cps[this.#at - 1]! % 32, this.#text(from));
      case "x":
        this.#at += 2;
        return single(parseInt(this.#text(this.#at - 2), 16), this.#text(from));
      case "u":
        return single(this.#unicodeEscape(), this.#text(from));
      case "-":
        if (inClass) return single(0x2d, this.#text(from));
        break;
    }
    const escaped = e.codePointAt(0)!;
    if (SYNTAX.has(escaped)) return single(escaped, this.#text(from));
    throw new RegexRefused(`cannot read the escape \\${e}`);
  }

  /** After `\u`: `{hex}`, or four hex digits, with a second `\uXXXX` when the two are a surrogate pair. */
  #unicodeEscape(): number {
    if (this.#eat("{")) {
      const from = this.#at;
      while (this.#peek() !== "}") this.#at++;
      const cp = parseInt(this.#text(from), 16);
      this.#eat("}");
      return cp;
    }
    const hex4 = () => {
      this.#at += 4;
      return parseInt(this.#text(this.#at - 4), 16);
    };
    const lead = hex4();
    if (lead >= 0xd800 && lead <= 0xdbff && this.#peek() === "\\" && this.#peek(1) === "u") {
      const save = this.#at;
      this.#at += 2;
      if (/^[0-9a-fA-F]{4}$/.test(String.fromCodePoint(...this.#cps.slice(this.#at, this.#at + 4)))) {
        const trail = hex4();
        if (trail >= 0xdc00 && trail <= 0xdfff) return (lead - 0xd800) * 0x400 + (trail - 0xdc00) + 0x10000;
      }
      this.#at = save;
    }
    return lead;
  }

  /** After `\p` or `\P`: `{Name}` or `{Name=Value}`. */
  #property(negated: boolean, from: number): CharSet {
    this.#eat("{");
    const start = this.#at;
    while (this.#peek() !== "}") this.#at++;
    const text = this.#text(start);
    this.#eat("}");
    const es = this.#text(from);
    const [name, value] = text.includes("=") ? text.split("=") as [string, string] : [undefined, text];
    const some = (ranges: Ranges): CharSet => ({
      items: itemsOf(ranges),
      negated,
      ranges: negated ? complement(ranges) : ranges,
      es,
    });
    let re2: string | undefined;
    if (name === undefined || name === "General_Category" || name === "gc") {
      re2 = SHORT_CATEGORIES.has(value) ? value : CATEGORIES[value];
      if (re2 === undefined && name === undefined) {
        if (value === "Any") return some([[0, MAX_CODE_POINT]]);
        if (value === "ASCII") return some([[0, 0x7f]]);
      }
    } else if (name === "Script" || name === "sc") {
      // RE2 names scripts as ECMAScript's long names do; a name it lacks fails to compile, and is refused then.
      re2 = /^[A-Za-z_]+$/.test(value) ? value : undefined;
    }
    if (re2 === undefined) throw new RegexRefused(`\\p{${text}} is not a property RE2 has`);
    return { items: `\\${negated ? "P" : "p"}{${re2}}`, negated: false, es };
  }
}

/** One code point. */
function single(cp: number, es: string): CharSet {
  return { items: hex(cp), negated: false, ranges: [[cp, cp]], es };
}

function hex(cp: number): string {
  return `\\x{${cp.toString(16)}}`;
}

/** RE2 class items for `ranges`. */
function itemsOf(ranges: Ranges): string {
  return ranges.map(([lo, hi]) => (lo === hi ? hex(lo) : `${hex(lo)}-${hex(hi)}`)).join("");
}

/** A negated escape (`\D`, `\S`, `\P{..}`...) as items inside another class. */
function negatedItem(set: CharSet): string {
  if (set.ranges) return itemsOf(set.ranges);
  throw new RegexRefused(`${set.es} inside a class is not something RE2 can write`);
}

function union(ranges: Ranges): Ranges {
  const sorted = [...ranges].sort((a, b) => a[0] - b[0]);
  const out: Ranges = [];
  for (const [lo, hi] of sorted) {
    const last = out[out.length - 1];
    if (last && lo <= last[1] + 1) last[1] = Math.max(last[1], hi);
    else out.push([lo, hi]);
  }
  return out;
}

function complement(ranges: Ranges): Ranges {
  const out: Ranges = [];
  let next = 0;
  for (const [lo, hi] of union(ranges)) {
    if (lo > next) out.push([next, lo - 1]);
    next = hi + 1;
  }
  if (next <= MAX_CODE_POINT) out.push([next, MAX_CODE_POINT]);
  return out;
}

// --- RE2 -----------------------------------------------------------------------------------------------------

/** The tree in RE2's syntax, with ECMAScript's meaning. */
function toRe2(node: Node): string {
  switch (node.type) {
    case "seq":
      return node.items.map(toRe2).join("");
    case "alt":
      return node.options.map(toRe2).join("|");
    case "group":
      return `(?:${toRe2(node.body)})`;
    case "assert":
      // Without the `m` flag, RE2's `^` and `$` are the start and end of the text, as ECMAScript's are.
      return node.re2;
    case "char": {
      const { items, negated } = node.set;
      // An empty class matches nothing, and negated, anything; RE2 has no empty class.
      if (items === "") return negated ? `[${itemsOf([[0, MAX_CODE_POINT]])}]` : `[^${itemsOf([[0, MAX_CODE_POINT]])}]`;
      return `[${negated ? "^" : ""}${items}]`;
    }
    case "repeat": {
      if (node.min > 1000 || (node.max !== Infinity && node.max > 1000)) {
        throw new RegexRefused(`${node.source}: RE2 repeats at most 1000 times`);
      }
      const quantifier = node.max === Infinity
        ? node.min === 0 ? "*" : node.min === 1 ? "+" : `{${node.min},}`
        : node.min === node.max
        ? `{${node.min}}`
        : node.min === 0 && node.max === 1
        ? "?"
        : `{${node.min},${node.max}}`;
      return `(?:${toRe2(node.body)})${quantifier}${node.lazy ? "?" : ""}`;
    }
  }
}

/** About the number of instructions RE2 compiles the tree to. */
function sizeOf(node: Node): number {
  switch (node.type) {
    case "seq":
      return node.items.reduce((sum, item) => sum + sizeOf(item), 0);
    case "alt":
      return node.options.reduce((sum, option) => sum + sizeOf(option) + 1, 0);
    case "group":
      return sizeOf(node.body);
    case "assert":
    case "char":
      return 1;
    case "repeat":
      return sizeOf(node.body) * Math.max(1, node.max === Infinity ? node.min : node.max) + 1;
  }
}

// --- The shape check -----------------------------------------------------------------------------------------

/** A repetition without an upper bound, and the characters it can match. */
interface Unbounded {
  source: string;
  chars: CharSet[];
}

/**
 * Refuses an expression whose shape would make a backtracking engine's work grow faster than its input: a
 * repetition inside a repetition (`(a+)+`), a repeated alternation (`(a|b)*`: write `[ab]*`), more than
 * `maxRepetitions` repetitions, and two repetitions without an upper bound that can match the same character
 * one after the other (`\d*\d*`, `\w+\s?\w+`: a run of digits can be split between them in as many ways as it
 * is long, and ten of them in its length to the tenth). `^[a-z]+-\d+$` and `^\S+@\S+$` are fine: what lies
 * between them must match first.
 */
function checkShape(tree: Node): void {
  let repetitions = 0;
  const refuse = (what: string): never => {
    throw new RegexRefused(
      `a pattern that could take unbounded time on some inputs (${what}): no nested repetition, no repeated ` +
        "alternation, no back-references or look-arounds, no two unbounded repetitions that can match the same " +
        `character one after the other, at most ${REGEX_LIMITS.maxRepetitions} repetitions`,
    );
  };
  const walk = (node: Node, repeated: boolean): void => {
    switch (node.type) {
      case "seq":
        return node.items.forEach((item) => walk(item, repeated));
      case "alt":
        if (repeated) refuse("a repeated alternation");
        return node.options.forEach((option) => walk(option, repeated));
      case "group":
        return walk(node.body, repeated);
      case "repeat":
        if (repeated) refuse(`a repetition inside a repetition: ${node.source}`);
        if (++repetitions > REGEX_LIMITS.maxRepetitions) refuse(`more than ${REGEX_LIMITS.maxRepetitions} repetitions`);
        return walk(node.body, true);
    }
  };
  walk(tree, false);
  const budget = { probes: PROBE_BUDGET };
  adjacent(tree, (a, b) => {
    if (overlap(a.chars, b.chars, budget)) {
      refuse(`${a.source} and ${b.source} can match the same character one after the other`);
    }
  });
}

/** What can start and end a match of a node, and whether it can match nothing. */
interface Ends {
  nullable: boolean;
  first: Unbounded[];
  last: Unbounded[];
}

/** Calls `pair` for each two unbounded repetitions that can match one right after the other. */
function adjacent(tree: Node, pair: (before: Unbounded, after: Unbounded) => void): void {
  const ends = (node: Node): Ends => {
    switch (node.type) {
      case "seq": {
        let acc: Ends = { nullable: true, first: [], last: [] };
        for (const item of node.items) {
          const next = ends(item);
          for (const a of acc.last) for (const b of next.first) pair(a, b);
          acc = {
            nullable: acc.nullable && next.nullable,
            first: acc.nullable ? [...acc.first, ...next.first] : acc.first,
            last: next.nullable ? [...acc.last, ...next.last] : next.last,
          };
        }
        return acc;
      }
      case "alt": {
        const all = node.options.map(ends);
        return {
          nullable: all.some((e) => e.nullable),
          first: all.flatMap((e) => e.first),
          last: all.flatMap((e) => e.last),
        };
      }
      case "group":
        return ends(node.body);
      case "assert":
        return { nullable: true, first: [], last: [] };
      case "char":
        return { nullable: false, first: [], last: [] };
      case "repeat": {
        const body = ends(node.body);
        const nullable = node.min === 0 || body.nullable;
        if (node.max !== Infinity) return { nullable, first: body.first, last: body.last };
        const self = { source: node.source, chars: charsIn(node.body) };
        return { nullable, first: [self], last: [self] };
      }
    }
  };
  ends(tree);
}

function charsIn(node: Node): CharSet[] {
  switch (node.type) {
    case "seq":
      return node.items.flatMap(charsIn);
    case "alt":
      return node.options.flatMap(charsIn);
    case "group":
    case "repeat":
      return charsIn(node.body);
    case "assert":
      return [];
    case "char":
      return [node.set];
  }
}

/** Characters tried one by one against a `\p{...}` set; past this many, the two are taken to overlap. */
const PROBE_LIMIT = 1_024;

/**
 * Characters tried in all for one pattern's shape check; past it, the pair being checked is taken to overlap (the
 * pattern is refused). Without it, pairs of classes and `\p{...}` sets multiplied: 14 crafted patterns of 1,000
 * characters in one schema took a definition check past its deadline, and a definition check Worker that runs
 * over its deadline is not stopped by terminate() (Deno 2.9.6): it spins on. The times, before and with it, are
 * in the README, "Tenant regular expressions cannot run long".
 */
const PROBE_BUDGET = 8_192;

/** Whether some character is in one of `a` and in one of `b` (taken as yes once `budget` is spent). */
function overlap(a: CharSet[], b: CharSet[], budget: { probes: number }): boolean {
  for (const x of a) {
    for (const y of b) {
      if (x.ranges && y.ranges) {
        if (intersects(x.ranges, y.ranges)) return true;
        continue;
      }
      const [known, unknown] = x.ranges ? [x, y] : [y, x];
      const count = known.ranges?.reduce((n, [lo, hi]) => n + hi - lo + 1, 0) ?? Infinity;
      if (count > PROBE_LIMIT) return true;
      budget.probes -= count;
      if (budget.probes < 0) return true;
      // One character against a set of the tenant's: linear in any engine.
      const probe = new RegExp(`^(?:${unknown.es})$`, "u");
      for (const [lo, hi] of known.ranges!) {
        for (let cp = lo; cp <= hi; cp++) if (probe.test(String.fromCodePoint(cp))) return true;
      }
    }
  }
  return false;
}

function intersects(a: Ranges, b: Ranges): boolean {
  let i = 0, j = 0;
  while (i < a.length && j < b.length) {
    const [alo, ahi] = a[i]!, [blo, bhi] = b[j]!;
    if (alo <= bhi && blo <= ahi) return true;
    if (ahi < bhi) i++;
    else j++;
  }
  return false;
}
