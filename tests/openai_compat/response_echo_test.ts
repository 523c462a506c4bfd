/**
 * What a Responses create's run keeps of its `background`, `instructions` and `metadata`, and how a response
 * object reads them back: the storage and the fallbacks, without a server (the door's test drives it end to end).
 */
import assert from "node:assert/strict";
import { echoOf, echoOfInput, NO_ECHO, withEcho } from "../../src/openai_compat/response_echo.ts";
import { readResponsesRequest } from "../../src/openai_compat/requests.ts";
import { chatCall } from "../../src/tasks/chat_task.ts";

const read = (body: Record<string, unknown>) => {
  const request = readResponsesRequest({ model: "fake-model", input: "Classify: the export crashes.", ...body });
  return { request, input: withEcho(request.input, echoOf(request)) };
};

Deno.test("withEcho() keeps background, the instructions' place and metadata; echoOfInput() reads them back", () => {
  const metadata = { ticket: "T-1042", team: "support" };
  const { input } = read({ background: true, instructions: "Answer in one line.", metadata });
  assert.deepEqual(input.response, { background: true, instructions_first: true, metadata });
  // The instructions are kept once, as the conversation's first message.
  assert.deepEqual(input.messages[0], { role: "system", content: "Answer in one line." });
  assert.deepEqual(echoOfInput(JSON.parse(JSON.stringify(input))), {
    background: true,
    instructions: "Answer in one line.",
    metadata,
  });
});

Deno.test("a create that sets none of them keeps the run input it always had", () => {
  for (const body of [{}, { background: false }, { metadata: {} }, { metadata: null, instructions: null }]) {
    const { request, input } = read(body);
    assert.equal(input, request.input, JSON.stringify(body));
    assert.ok(!("response" in input));
    assert.deepEqual(echoOfInput(input), NO_ECHO);
  }
});

Deno.test("the model call reads none of the echo", () => {
  const echoing = read({ background: true, instructions: "Be brief.", metadata: { a: "b" } }).input;
  const plain = read({ instructions: "Be brief." }).request.input;
  assert.deepEqual(chatCall(echoing), chatCall(plain));
});

Deno.test("echoOfInput(): the request's own system message is not instructions; malformed values are defaults", () => {
  const own = read({ input: [{ role: "system", content: "Mine" }, { role: "user", content: "Hi" }] }).input;
  assert.deepEqual(echoOfInput(own), NO_ECHO);
  assert.deepEqual(echoOfInput(undefined), NO_ECHO);
  assert.deepEqual(echoOfInput("text"), NO_ECHO);
  assert.deepEqual(
    echoOfInput({
      messages: [],
      response: { background: "yes", instructions_first: true, metadata: { n: 1 } },
    }),
    NO_ECHO,
  );
});
