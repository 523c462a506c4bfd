/**
 * The fake Chat Completions server as its own process, so the model's CPU is
 * not charged to the process under test. Prints its base URL, then serves
 * until SIGTERM. Usage: model_server.ts DELAY_MS [ANSWERS_FILE]
 *
 * ANSWERS_FILE (JSON, `[{"marker": string, "content": string}, ...]`): a
 * request any of whose messages contains a marker is answered that content,
 * its repair call too (the first user message is sent again with it); any
 * other request gets the fake's default answer (for a `json_schema` request,
 * a value valid against the schema).
 */
import { type ChatBody, completionBody, defaultAnswer, startFakeModel } from "../support/fake_model_server.ts";

const delayMs = Number(Deno.args[0] ?? 0);
const answersFile = Deno.args[1];
let close: () => Promise<void>;
if (answersFile === undefined) {
  const model = startFakeModel(() => ({ kind: "ok", delayMs }));
  console.log(model.url);
  close = model.close;
} else {
  const answers = JSON.parse(await Deno.readTextFile(answersFile)) as { marker: string; content: string }[];
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, async (req) => {
    if (!new URL(req.url).pathname.endsWith("/chat/completions")) return new Response("not found", { status: 404 });
    const body = await req.json() as ChatBody;
    if (delayMs) await new Promise((r) => setTimeout(r, delayMs));
    const scripted = answers.find(({ marker }) => body.messages?.some((m) => m.content?.includes(marker)));
    return Response.json(completionBody(scripted ? scripted.content : defaultAnswer(body), body.model));
  });
  console.log(`http://127.0.0.1:${server.addr.port}/v1`);
  close = () => server.shutdown();
}
await new Promise<void>((resolve) => Deno.addSignalListener("SIGTERM", resolve));
await close();
