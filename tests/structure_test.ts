/**
 * The shape of `src/` (issue 38): no import cycle between files, none between
 * folders (each root file of `src/` is a node of its own), type-only and
 * dynamic imports included, no function over 150 lines, and every Redis
 * script in a `*_script.ts` module of its own with a header naming its KEYS.
 * Imports, functions and scripts are read with regular expressions: `deno
 * fmt` keeps their form and the indentation regular.
 */
import assert from "node:assert/strict";

/** The most lines a function may span, from its declaration to its closing brace. */
const MAX_FUNCTION_LINES = 150;

const SRC = decodeURIComponent(new URL("../src/", import.meta.url).pathname);

/** `import ... from`, `import type ... from`, `export ... from`, `export type ... from`, `export * from`. */
const FROM =
  /^\s*(?:import|export)\s+(?:type\s+)?(?:\{[^}]*\}|\*(?:\s+as\s+[\w$]+)?|[\w$]+(?:\s*,\s*(?:\{[^}]*\}|\*\s+as\s+[\w$]+))?)\s+from\s+["']([^"']+)["']/gm;
/** `import "./x.ts"` for its effects. */
const BARE = /^\s*import\s+["']([^"']+)["']/gm;
/** `import("./x.ts")`, loaded when called. */
const DYNAMIC = /\bimport\(\s*["']([^"']+)["']\s*\)/g;

/** Each `.ts` file under `src/` by its path from `src/`, with its text. */
async function sources(): Promise<Map<string, string>> {
  const out = new Map<string, string>();
  const walk = async (dir: string): Promise<void> => {
    for await (const entry of Deno.readDir(`${SRC}${dir}`)) {
      const path = `${dir}${entry.name}`;
      if (entry.isDirectory) await walk(`${path}/`);
      else if (entry.isFile && path.endsWith(".ts")) out.set(path, await Deno.readTextFile(`${SRC}${path}`));
    }
  };
  await walk("");
  return out;
}

/** The path from `src/` of each relative module `file` imports, in any form; a path outside `src/` starts with `../`. */
function importsOf(file: string, text: string): string[] {
  const base = new URL(file, "file:///src/");
  const out: string[] = [];
  for (const re of [FROM, BARE, DYNAMIC]) {
    for (const [, specifier] of text.matchAll(re)) {
      if (!specifier!.startsWith(".")) continue;
      const path = decodeURIComponent(new URL(specifier!, base).pathname);
      out.push(path.startsWith("/src/") ? path.slice("/src/".length) : `..${path}`);
    }
  }
  return out;
}

/** A directed graph: each node's successors. */
type Graph = Map<string, Set<string>>;

function addEdge(graph: Graph, from: string, to: string): void {
  if (!graph.has(from)) graph.set(from, new Set());
  if (!graph.has(to)) graph.set(to, new Set());
  graph.get(from)!.add(to);
}

/** Tarjan's strongly connected components; a node on a cycle shares its component with another, or imports itself. */
function components(graph: Graph): string[][] {
  let next = 0;
  const index = new Map<string, number>();
  const low = new Map<string, number>();
  const stack: string[] = [];
  const onStack = new Set<string>();
  const out: string[][] = [];
  const visit = (v: string): void => {
    index.set(v, next);
    low.set(v, next);
    next++;
    stack.push(v);
    onStack.add(v);
    for (const w of graph.get(v) ?? []) {
      if (!index.has(w)) {
        visit(w);
        low.set(v, Math.min(low.get(v)!, low.get(w)!));
      } else if (onStack.has(w)) {
        low.set(v, Math.min(low.get(v)!, index.get(w)!));
      }
    }
    if (low.get(v) === index.get(v)) {
      const component: string[] = [];
      let w: string;
      do {
        w = stack.pop()!;
        onStack.delete(w);
        component.push(w);
      } while (w !== v);
      out.push(component.sort());
    }
  };
  for (const v of [...graph.keys()].sort()) if (!index.has(v)) visit(v);
  return out;
}

/** The components that hold a cycle. */
function cycles(graph: Graph): string[][] {
  return components(graph).filter((c) => c.length > 1 || graph.get(c[0]!)!.has(c[0]!));
}

/** A shortest cycle through the first node of `component`, as the path back to it: `[a, b, a]`. */
function shortestCycle(graph: Graph, component: string[]): string[] {
  const start = component[0]!;
  const inside = new Set(component);
  const previous = new Map<string, string>();
  const queue = [start];
  for (let i = 0; i < queue.length; i++) {
    const v = queue[i]!;
    for (const w of graph.get(v) ?? []) {
      if (!inside.has(w)) continue;
      if (w === start) {
        const path: string[] = [];
        for (let at = v; at !== start; at = previous.get(at)!) path.unshift(at);
        return [start, ...path, start];
      }
      if (!previous.has(w)) {
        previous.set(w, v);
        queue.push(w);
      }
    }
  }
  return component;
}

/** The folder of a file under `src/`; a root file is a node of its own. */
const folderOf = (file: string): string => file.includes("/") ? file.slice(0, file.indexOf("/")) : file;

/** The import graph of the files under `src/`, checked: every relative import names a file that exists. */
async function fileGraph(): Promise<Graph> {
  const files = await sources();
  const graph: Graph = new Map([...files.keys()].map((file) => [file, new Set<string>()]));
  const missing: string[] = [];
  for (const [file, text] of files) {
    for (const target of importsOf(file, text)) {
      if (files.has(target)) addEdge(graph, file, target);
      else if (!(await Deno.stat(`${SRC}${target}`).then(() => true, () => false))) {
        missing.push(`${file} -> ${target}`);
      }
    }
  }
  assert.deepEqual(missing, [], "relative imports read from src/ name files that exist (else the parsing is wrong)");
  return graph;
}

Deno.test("no file under src/ is on an import cycle, type-only and dynamic imports included", async () => {
  const graph = await fileGraph();
  const found = cycles(graph).map((c) => `${shortestCycle(graph, c).join(" -> ")} (cycle of ${c.join(", ")})`);
  assert.deepEqual(found, [], `file-level import cycles:\n  ${found.join("\n  ")}`);
});

Deno.test("no folder of src/ is on an import cycle, each root file of src/ a node of its own", async () => {
  const files = await fileGraph();
  const folders: Graph = new Map();
  /** The file-level imports behind each folder-level one, `from -> to`. */
  const behind = new Map<string, string[]>();
  for (const [file, targets] of files) {
    for (const target of targets) {
      const [from, to] = [folderOf(file), folderOf(target)];
      if (from === to) continue;
      addEdge(folders, from, to);
      behind.set(`${from} -> ${to}`, [...behind.get(`${from} -> ${to}`) ?? [], `${file} -> ${target}`]);
    }
  }
  const found = cycles(folders).map((c) => {
    const path = shortestCycle(folders, c);
    const hops = path.slice(1).map((to, i) => {
      const edge = `${path[i]} -> ${to}`;
      const files = behind.get(edge)!;
      return `    ${edge}: ${files.slice(0, 3).join(", ")}${files.length > 3 ? `, and ${files.length - 3} more` : ""}`;
    });
    return `${path.join(" -> ")} (cycle of ${c.join(", ")})\n${hops.join("\n")}`;
  });
  assert.deepEqual(found, [], `folder-level import cycles:\n  ${found.join("\n  ")}`);
});

/** A function's declaration: `function f(`, `export async function* f(`, `const f = (`, `const f = async function (`. */
const DECLARATION =
  /^(\s*)(?:export\s+)?(?:default\s+)?(?:async\s+)?function\s*\*?\s*([\w$]+)\s*[<(]|^(\s*)(?:export\s+)?const\s+([\w$]+)(?:\s*:[^=]+)?\s*=\s*(?:async\s+)?(?:function\b[^(]*)?(?:<[^>]*>\s*)?\(/;

/**
 * For each line, whether it starts inside a template literal (its text or a `${}` in it), where indentation
 * means nothing. A small lexer: comments, quoted strings (one line each), escapes (a regular expression's too)
 * and templates, nested through `${}`.
 * @throws when a file ends inside a template or a comment: the lexer misread it.
 */
function templateLines(file: string, lines: string[]): boolean[] {
  /** "`" for a template's text, "{" for a brace open inside one (its `${` included). */
  const stack: string[] = [];
  let comment = false;
  const out: boolean[] = [];
  for (const line of lines) {
    out.push(stack.length > 0);
    let quote: string | undefined;
    for (let i = 0; i < line.length; i++) {
      const c = line[i]!;
      const pair = line.slice(i, i + 2);
      if (comment) {
        if (pair === "*/") {
          comment = false;
          i++;
        }
      } else if (stack.at(-1) === "`") {
        if (c === "\\") i++;
        else if (c === "`") stack.pop();
        else if (pair === "${") {
          stack.push("{");
          i++;
        }
      } else if (quote) {
        if (c === "\\") i++;
        else if (c === quote) quote = undefined;
      } else if (c === "\\") {
        i++; // in code, only in a regular expression: `/\//` is no comment
      } else if (pair === "//") {
        break;
      } else if (pair === "/*") {
        comment = true;
        i++;
      } else if (c === "'" || c === '"') quote = c;
      else if (c === "`") stack.push("`");
      else if (c === "{" && stack.length > 0) stack.push("{");
      else if (c === "}" && stack.length > 0) stack.pop();
    }
  }
  assert.ok(stack.length === 0 && !comment, `${file} ends inside a template or a comment: the lexer misread it`);
  return out;
}

/** Each function in `file` with its line (1-based) and how many lines it spans, declaration to closing brace. */
function functionsOf(file: string, text: string): { name: string; line: number; lines: number }[] {
  const lines = text.split("\n");
  const inTemplate = templateLines(file, lines);
  const indent = (line: string) => line.search(/\S/);
  const out: { name: string; line: number; lines: number }[] = [];
  for (let i = 0; i < lines.length; i++) {
    const m = inTemplate[i] ? null : DECLARATION.exec(lines[i]!);
    if (!m) continue;
    const depth = (m[1] ?? m[3]!).length;
    // The body ends at the first line back at the declaration's indentation that closes a brace; a line there
    // that closes the parameters (`) => {`, `): T {`) is still the head, and anything else means no block body
    // (`const f = (x) => x + 1;`, an overload signature, a value that is not a function). Lines in a template
    // literal are text, whatever their indentation.
    for (let j = i + 1; j < lines.length; j++) {
      const line = lines[j]!;
      if (inTemplate[j] || line.trim() === "" || indent(line) > depth) continue;
      if (indent(line) < depth) break;
      if (line.trimStart().startsWith(")")) continue;
      if (line.trimStart().startsWith("}")) out.push({ name: m[2] ?? m[4]!, line: i + 1, lines: j - i + 1 });
      break;
    }
  }
  return out;
}

Deno.test(`no function in src/ is over ${MAX_FUNCTION_LINES} lines`, async () => {
  const long: { name: string; where: string }[] = [];
  for (const [file, text] of await sources()) {
    for (const f of functionsOf(file, text)) {
      if (f.lines > MAX_FUNCTION_LINES) {
        long.push({ name: f.name, where: `${f.name} (${file}:${f.line}, ${f.lines} lines)` });
      }
    }
  }
  const found = long.map((f) => f.where);
  assert.deepEqual(found, [], `functions over ${MAX_FUNCTION_LINES} lines:\n  ${found.join("\n  ")}`);
});

/** A call of `defineScript(`, not its declaration (`function defineScript(`). */
const DEFINE_SCRIPT = /(?<!function\s+)\bdefineScript\(/g;
const DEFINE_SCRIPT_LINE = new RegExp(DEFINE_SCRIPT.source);

/**
 * The header of each script a file defines: the comment lines right above its `defineScript(` line (`//`, or a
 * JSDoc's) and the Lua comment lines (`--`) that open its body.
 */
function scriptHeaders(text: string): string[] {
  const lines = text.split("\n");
  const out: string[] = [];
  for (let i = 0; i < lines.length; i++) {
    if (!DEFINE_SCRIPT_LINE.test(lines[i]!)) continue;
    const header: string[] = [];
    for (let j = i - 1; j >= 0 && /^\s*(?:\/\/|\/\*|\*)/.test(lines[j]!); j--) header.unshift(lines[j]!);
    for (let j = i + 1; j < lines.length && /^\s*--/.test(lines[j]!); j++) header.push(lines[j]!);
    out.push(header.join("\n"));
  }
  return out;
}

Deno.test("every Redis script has a module of its own", async () => {
  const found: string[] = [];
  for (const [file, text] of await sources()) {
    const calls = text.match(DEFINE_SCRIPT)?.length ?? 0;
    if (file.endsWith("_script.ts")) {
      if (calls !== 1) found.push(`${file}: ${calls} defineScript( calls in a *_script.ts module, not one`);
    } else if (calls > 0) {
      found.push(`${file}: ${calls} defineScript( call(s) outside a *_script.ts module (give each its own)`);
    }
    if (scriptHeaders(text).some((header) => !/\bKEYS\b/.test(header) && !/\bno keys\b/i.test(header))) {
      found.push(
        `${file}: a script's header (the comments right above or opening its Lua) names no KEYS and does not say it takes no keys`,
      );
    }
  }
  found.sort();
  assert.deepEqual(found, [], `Redis scripts out of their own module or header:\n  ${found.join("\n  ")}`);
});
