import assert from "node:assert/strict";
import { BatchRefused, createBatchClient } from "../../src/batches/batch_client.ts";
import { UpstreamHttpError } from "../../src/retry/errors.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import type { BatchApiStep, BatchScript } from "../support/fake_batch_api.ts";

const line = (id: string, content = `text ${id}`) =>
  JSON.stringify({
    custom_id: id,
    method: "POST",
    url: "/v1/chat/completions",
    body: { model: "m", messages: [{ role: "user", content }] },
  });

async function withFake(script: (n: number) => BatchScript, test: (f: ReturnType<typeof setup>) => Promise<void>) {
  const server = startFakeModel(undefined, { batches: script });
  try {
    await test(setup(server));
  } finally {
    await server.close();
  }
}

function setup(server: ReturnType<typeof startFakeModel>) {
  return { server, client: createBatchClient({ apiKey: "k", baseURL: server.url }) };
}

/** The JSONL lines of a file, parsed. */
async function lines(client: ReturnType<typeof createBatchClient>, fileId: string | null | undefined) {
  if (!fileId) return [];
  return (await client.content(fileId)).split("\n").filter(Boolean).map((l) => JSON.parse(l));
}

Deno.test("fake Batch API: upload, create with metadata, poll to completed, read the output through the SDK", async () => {
  await withFake(() => ({ delayMs: 50 }), async ({ server, client }) => {
    const file = await client.upload([line("a"), line("b")].join("\n") + "\n", "b1.jsonl");
    const created = await client.create(file, "our-1");
    assert.equal(created.status, "in_progress");
    assert.deepEqual(created.metadata, { oncely_batch: "our-1" });
    let b = created;
    while (b.status !== "completed") {
      await new Promise((r) => setTimeout(r, 20));
      b = await client.retrieve(created.id);
    }
    const out = await lines(client, b.output_file_id);
    assert.deepEqual(out.map((l) => l.custom_id).sort(), ["a", "b"]);
    assert.equal(out[0].response.status_code, 200);
    assert.equal(out[0].response.body.object, "chat.completion");
    assert.ok(out[0].response.body.usage.prompt_tokens > 0);
    assert.equal(b.error_file_id, null);
    assert.deepEqual(server.batches.counts.uploads, 1);
  });
});

Deno.test("fake Batch API: partial failures go to the error file; an error-only completion has no output file", async () => {
  await withFake(
    (n) => ({
      line: (id) => (n === 2 || id === "b" ? { kind: "error", status: 400, message: "bad" } : { kind: "ok" }),
    }),
    async ({ client }) => {
      const first = await client.retrieve(
        (await client.create(await client.upload(line("a") + "\n" + line("b"), "f"), "x")).id,
      );
      assert.equal(first.status, "completed");
      assert.deepEqual((await lines(client, first.output_file_id)).map((l) => l.custom_id), ["a"]);
      const errors = await lines(client, first.error_file_id);
      assert.deepEqual(errors.map((l) => [l.custom_id, l.response.status_code, l.response.body.error.message]), [
        ["b", 400, "bad"],
      ]);
      const second = await client.retrieve((await client.create(await client.upload(line("c"), "f"), "y")).id);
      assert.equal(second.status, "completed");
      assert.equal(second.output_file_id, null);
      assert.equal((await lines(client, second.error_file_id)).length, 1);
    },
  );
});

Deno.test("fake Batch API: an expired batch keeps its completed lines and reports the rest batch_expired", async () => {
  await withFake(
    () => ({ end: "expired", line: (id) => (id === "a" ? { kind: "ok" } : { kind: "unfinished" }) }),
    async ({ client }) => {
      const b = await client.retrieve(
        (await client.create(await client.upload(line("a") + "\n" + line("b"), "f"), "z")).id,
      );
      assert.equal(b.status, "expired");
      assert.deepEqual((await lines(client, b.output_file_id)).map((l) => l.custom_id), ["a"]);
      const [expired] = await lines(client, b.error_file_id);
      assert.equal(expired.custom_id, "b");
      assert.equal(expired.response, null);
      assert.equal(expired.error.code, "batch_expired");
    },
  );
});

Deno.test("fake Batch API: a lost create reply is found again by listing with after= and matching metadata", async () => {
  await withFake(() => ({ delayMs: 60_000 }), async ({ server, client }) => {
    // Enough batches to need more than one page of 100.
    const file = await client.upload(line("a"), "f");
    for (let i = 0; i < 120; i++) await client.create(file, `other-${i}`);
    const since = Math.floor(Date.now() / 1000) - 5;
    const first = await client.create(file, "ours-old");
    for (let i = 0; i < 130; i++) await client.create(file, `later-${i}`);
    server.batches.loseCreateReplies(1);
    await assert.rejects(client.create(file, "ours"), (e: Error) => e.name === "UpstreamHttpError");
    const found = await client.findByMetadata("ours", since);
    assert.ok(found);
    assert.deepEqual(found.metadata, { oncely_batch: "ours" });
    assert.equal((await client.findByMetadata("ours-old", since))?.id, first.id);
    assert.ok(server.batches.counts.lists >= 3, "paged with after=");
    assert.equal(await client.findByMetadata("never", since), undefined);
    await client.cancel(found.id);
    const cancelled = await client.retrieve(found.id);
    assert.equal(cancelled.status, "cancelled");
    assert.equal((await lines(client, cancelled.error_file_id))[0].error.code, "batch_cancelled");
  });
});

Deno.test("fake Batch API: a file with a duplicate custom_id fails its batch (sglang#1415 hung instead)", async () => {
  await withFake(() => ({}), async ({ client }) => {
    const b = await client.retrieve(
      (await client.create(await client.upload(line("a") + "\n" + line("a"), "f"), "d")).id,
    );
    assert.equal(b.status, "failed");
    assert.equal(b.output_file_id, null);
  });
});

Deno.test("fake Batch API: a batch scripted to fail validation ends failed, with no file and its reason", async () => {
  await withFake(
    (n) => (n === 1 ? { end: "failed", failure: { code: "token_limit_exceeded", message: "too many" } } : {}),
    async ({ server, client }) => {
      const b = await client.retrieve((await client.create(await client.upload(line("a"), "f"), "v")).id);
      assert.equal(b.status, "failed");
      assert.equal(b.output_file_id, null);
      assert.equal(b.error_file_id, null);
      const raw = await (await fetch(`${server.url}/batches/${b.id}`, { headers: { authorization: "Bearer k" } }))
        .json();
      assert.deepEqual(raw.errors.data.map((e: { code: string; message: string }) => [e.code, e.message]), [[
        "token_limit_exceeded",
        "too many",
      ]]);
      assert.ok(raw.failed_at);
      const next = await client.retrieve((await client.create(await client.upload(line("b"), "f"), "w")).id);
      assert.equal(next.status, "completed", "only the batch scripted so");
    },
  );
});

Deno.test("fake Batch API: the after hook runs once the work is done, before the answer, which a client that left loses", async () => {
  const events: BatchApiStep[] = [];
  let holdCreate: Promise<void> | undefined;
  let createDone!: () => void;
  const server = startFakeModel(undefined, {
    batches: () => ({}),
    afterBatchStep: async (event) => {
      events.push(event);
      if (event.step === "create" && holdCreate) {
        createDone();
        await holdCreate;
      }
    },
  });
  try {
    const client = createBatchClient({ apiKey: "k", baseURL: server.url });
    const file = await client.upload(line("a") + "\n" + line("b") + "\n", "f");
    assert.deepEqual(events, [{ step: "upload", fileId: file, filename: "f", lines: 2 }]);
    // The create is held in the hook while its client gives up: the batch exists, the answer is lost.
    let release!: () => void;
    holdCreate = new Promise((resolve) => (release = resolve));
    const reached = new Promise<void>((resolve) => (createDone = resolve));
    const giveUp = new AbortController();
    const lost = fetch(`${server.url}/batches`, {
      method: "POST",
      headers: { "content-type": "application/json", authorization: "Bearer k" },
      body: JSON.stringify({
        input_file_id: file,
        endpoint: "/v1/chat/completions",
        completion_window: "24h",
        metadata: { oncely_batch: "ours" },
      }),
      signal: giveUp.signal,
    });
    await reached;
    giveUp.abort();
    await assert.rejects(lost);
    release();
    holdCreate = undefined;
    assert.deepEqual(server.batches.batches.map((b) => [b.metadata, b.customIds]), [[{ oncely_batch: "ours" }, [
      "a",
      "b",
    ]]]);
    const found = await client.findByMetadata("ours", 0);
    assert.ok(found);
    const ended = await client.retrieve(found.id);
    await client.content(ended.output_file_id!);
    assert.deepEqual(events.slice(1).map((e) => e.step), ["create", "list", "retrieve", "content"]);
    assert.deepEqual(events.at(-2), { step: "retrieve", batchId: found.id, status: "completed" });
    assert.deepEqual(events.at(-1), {
      step: "content",
      fileId: ended.output_file_id,
      file: "output",
      batchId: found.id,
    });
  } finally {
    await server.close();
  }
});

Deno.test("fake Batch API: scripted upload and create failures; the client refuses for good a 4xx but 408, 409, 429", async () => {
  await withFake(() => ({}), async ({ server, client }) => {
    const api = server.batches;
    api.failNext("upload", { status: 413, message: "File too large.", times: 2 });
    for (let i = 0; i < 2; i++) {
      await assert.rejects(client.upload(line("a"), "f"), (e: unknown) => {
        assert.ok(e instanceof BatchRefused);
        assert.deepEqual([e.step, e.status, e.providerMessage], ["upload", 413, "File too large."]);
        assert.ok(e.cause instanceof UpstreamHttpError);
        return true;
      });
    }
    const file = await client.upload(line("a"), "f");
    assert.equal(api.counts.uploads, 3, "each refused upload is counted");
    for (const status of [400, 401, 403, 404, 413, 422]) {
      api.failNext("create", { status });
      await assert.rejects(
        client.create(file, "ours"),
        (e: unknown) => e instanceof BatchRefused && e.step === "create" && e.status === status,
      );
    }
    for (const status of [408, 409, 429, 500, 503]) {
      api.failNext("create", { status });
      await assert.rejects(
        client.create(file, "ours"),
        (e: unknown) => !(e instanceof BatchRefused) && e instanceof UpstreamHttpError && e.status === status,
      );
    }
    assert.equal(api.batches.length, 0, "a failed create creates nothing");
    assert.equal(api.counts.creates, 11);
    const created = await client.create(file, "ours");
    assert.deepEqual(created.metadata, { oncely_batch: "ours" }, "no failure scripted any more");
    assert.equal(api.batches.length, 1);
  });
});
