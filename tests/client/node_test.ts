/**
 * The client stands alone and runs in Node: its source is erasable
 * TypeScript that uses no Deno API, Node runs it from its `.ts` source with
 * type stripping (where the installed Node has it), and a JavaScript bundle
 * of it runs on older Node. In Node, a script verifies a webhook signed with
 * `node:crypto` and lists tasks from the real API.
 */
import assert from "node:assert/strict";
import { serveTestApi } from "./_served_api.ts";

const CLIENT = new URL("../../src/client/client.ts", import.meta.url);

/** The script Node runs: argv is the client module's URL, the API's URL and an API key. */
const NODE_SCRIPT = `
import { createHmac } from "node:crypto";
const [moduleUrl, baseUrl, apiKey] = process.argv.slice(2);
const { createClient, verifyWebhook, WebhookVerificationError } = await import(moduleUrl);
const key = Buffer.from("a node secret of 24 byte");
const secret = "whsec_" + key.toString("base64");
const id = "msg_node_1";
const timestamp = String(Math.floor(Date.now() / 1000));
const body = JSON.stringify({ type: "summary.ready", job_id: "5e0f4d6e-0000-4000-8000-000000000001", status: "done", summary: "From Node." });
const signature = "v1," + createHmac("sha256", key).update(id + "." + timestamp + "." + body).digest("base64");
const headers = { "webhook-id": id, "webhook-timestamp": timestamp, "webhook-signature": signature };
const payload = await verifyWebhook({ secret, headers, body });
let tampered = "accepted";
await verifyWebhook({ secret, headers, body: body.replace("Node", "Deno") }).catch((error) => {
  tampered = error instanceof WebhookVerificationError ? "refused" : String(error);
});
const tasks = (await createClient({ baseUrl, apiKey }).listTasks()).map((task) => task.name);
console.log(JSON.stringify({ payload, tampered, tasks }));
`;

/** Node: NODE_BIN when set (`.ci/run` installs a Node 22 from npm when the machine's is older), else `node`. */
const NODE = Deno.env.get("NODE_BIN") || "node";

/** The installed Node's version, or undefined when there is none. */
async function nodeVersion(): Promise<{ major: number; minor: number; text: string } | undefined> {
  try {
    const out = await new Deno.Command(NODE, { args: ["--version"], stdout: "piped", stderr: "null" }).output();
    const text = new TextDecoder().decode(out.stdout).trim();
    const match = /^v(\d+)\.(\d+)\./.exec(text);
    return match ? { major: Number(match[1]), minor: Number(match[2]), text } : undefined;
  } catch {
    return undefined;
  }
}

const node = await nodeVersion();
/** Node's flags for running `.ts` by type stripping: on by default from 23.6, behind a flag from 22.7 (22.6 lacked module detection). */
const stripFlags = !node
  ? undefined
  : node.major > 23 || (node.major === 23 && node.minor >= 6)
  ? []
  : node.major >= 22 && (node.major > 22 || node.minor >= 7)
  ? ["--experimental-strip-types"]
  : undefined;
if (!node) console.log("node_test: no node on PATH; the Node tests are skipped");
else if (!stripFlags) {
  console.log(`node_test: node ${node.text} has no type stripping (22.7+); only the bundled client runs in Node here`);
}

/** Runs the script in Node against `moduleUrl`, with the served API; returns what it printed. */
async function runInNode(moduleUrl: string, flags: string[]) {
  const api = await serveTestApi();
  const dir = await Deno.makeTempDir();
  try {
    const script = `${dir}/check.mjs`;
    await Deno.writeTextFile(script, NODE_SCRIPT);
    const out = await new Deno.Command(NODE, {
      args: [...flags, script, moduleUrl, api.url, api.apiKey],
      stdout: "piped",
      stderr: "piped",
    }).output();
    const stderr = new TextDecoder().decode(out.stderr);
    assert.equal(out.code, 0, stderr);
    return JSON.parse(new TextDecoder().decode(out.stdout));
  } finally {
    await Deno.remove(dir, { recursive: true });
    await api.close();
  }
}

const EXPECTED = {
  payload: {
    type: "summary.ready",
    job_id: "5e0f4d6e-0000-4000-8000-000000000001",
    status: "done",
    summary: "From Node.",
  },
  tampered: "refused",
  tasks: ["summarize"],
};

Deno.test("the client is erasable TypeScript that uses no Deno API", async () => {
  const dir = await Deno.makeTempDir();
  try {
    // Node's type stripping only erases: no enums, namespaces or parameter properties, `import type` for
    // types. Web and ECMAScript libraries only, so a Deno.* call would not compile.
    const config = `${dir}/deno.json`;
    await Deno.writeTextFile(
      config,
      JSON.stringify({
        compilerOptions: {
          strict: true,
          noUncheckedIndexedAccess: true,
          noImplicitOverride: true,
          erasableSyntaxOnly: true,
          verbatimModuleSyntax: true,
          lib: ["esnext", "dom"],
        },
      }),
    );
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["check", "--quiet", "--config", config, CLIENT.pathname],
      stdout: "piped",
      stderr: "piped",
    }).output();
    assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test({
  name: "Node runs the client from its TypeScript source with type stripping",
  ignore: !stripFlags,
  async fn() {
    assert.deepEqual(await runInNode(CLIENT.href, stripFlags!), EXPECTED);
  },
});

Deno.test({
  name: "Node runs the client bundled to JavaScript",
  ignore: !node,
  async fn() {
    const dir = await Deno.makeTempDir();
    try {
      const bundle = `${dir}/oncely_client.mjs`;
      const out = await new Deno.Command(Deno.execPath(), {
        args: ["bundle", "--quiet", "--platform", "browser", "-o", bundle, CLIENT.pathname],
        stdout: "piped",
        stderr: "piped",
      }).output();
      assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
      assert.deepEqual(await runInNode(new URL(`file://${bundle}`).href, []), EXPECTED);
    } finally {
      await Deno.remove(dir, { recursive: true });
    }
  },
});
