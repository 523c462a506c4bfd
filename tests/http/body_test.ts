import assert from "node:assert/strict";
import { duplicateKey, readBody, readFormBody, readJsonBody } from "../../src/http/body.ts";
import { errorResponse, HttpError } from "../../src/http/problem.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { rawConnect } from "./raw_client.ts";

/** A real Deno.serve whose handler reads the body with `read` and answers 200, or the refusal. */
function serveReading(read: (req: Request) => Promise<unknown>) {
  return Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
    try {
      await read(req);
      return new Response("read", { status: 200 });
    } catch (error) {
      return errorResponse(error, silentLogger);
    }
  });
}

const json = (req: Request) => readJsonBody(req, 64 * 1024, { deadlineMs: 500 });

for (const framing of ["content-length", "chunked"] as const) {
  Deno.test(`a body dripped a byte at a time (${framing}) gets 408 at the deadline, then the socket is closed`, async () => {
    const server = serveReading(json);
    const conn = await rawConnect(server.addr.port);
    try {
      const started = performance.now();
      await conn.write(
        "POST /x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
          (framing === "chunked" ? "Transfer-Encoding: chunked\r\n\r\n" : "Content-Length: 100\r\n\r\n"),
      );
      // A chunked body drips whole one-byte chunks, "1\r\na\r\n", one every 100 ms.
      const drip = framing === "chunked"
        ? (() => {
          const timer = setInterval(() => conn.write("1\r\na\r\n"), 100);
          return { stop: () => clearInterval(timer) };
        })()
        : conn.drip("a".repeat(100), 100);
      const { status, at } = await conn.statusLine(3_000);
      assert.equal(status, 408);
      assert.ok(at - started < 1_500, `408 after ${Math.round(at - started)} ms (deadline 500 ms)`);
      const closedAt = await conn.closed(2_000);
      drip.stop();
      assert.notEqual(closedAt, "open", `the socket is still open 2 s after the 408: ${JSON.stringify(conn.received)}`);
      assert.ok(
        (closedAt as number) - at < 1_000,
        `closed ${Math.round((closedAt as number) - at)} ms after the 408`,
      );
      assert.equal(conn.received.match(/\r\nconnection: close\r\n/gi)?.length, 1, "one Connection: close, not two");
    } finally {
      conn.close();
      await server.shutdown();
    }
  });
}

for (const framing of ["content-length", "chunked"] as const) {
  Deno.test(`a body over the limit (${framing}) gets 413 and the connection is closed, not read to its end`, async () => {
    const server = serveReading(json);
    const conn = await rawConnect(server.addr.port);
    try {
      await conn.write(
        "POST /x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
          (framing === "chunked"
            ? "Transfer-Encoding: chunked\r\n\r\n"
            : `Content-Length: ${200 * 1024 * 1024}\r\n\r\n`),
      );
      // Keep sending, as a client uploading 200 MiB would, until the server stops taking it.
      const piece = new Uint8Array(64 * 1024).fill(0x61);
      const frame = framing === "chunked"
        ? new Uint8Array([...new TextEncoder().encode("10000\r\n"), ...piece, 13, 10])
        : piece;
      let sent = 0;
      const sending = (async () => {
        while (sent < 200 * 1024 * 1024 && await conn.write(frame)) sent += piece.length;
      })();
      const { status, at } = await conn.statusLine(5_000);
      assert.equal(status, 413);
      const closedAt = await conn.closed(3_000);
      assert.notEqual(closedAt, "open", `the server was still reading the body 3 s after the 413 (${sent} bytes sent)`);
      assert.ok((closedAt as number) - at < 1_000, `closed ${Math.round((closedAt as number) - at)} ms after the 413`);
      await sending;
      assert.ok(sent < 100 * 1024 * 1024, `the client could send only part of the body (${sent} bytes)`);
    } finally {
      conn.close();
      await server.shutdown();
    }
  });
}

Deno.test("readBody() returns the bytes of a body within the limit, declared or streamed", async () => {
  const text = "x".repeat(5000);
  assert.equal(
    new TextDecoder().decode(
      await readBody(new Request("http://x", { method: "POST", body: text }), { maxBytes: 5000 }),
    ),
    text,
  );
  const streamed = new Request("http://x", {
    method: "POST",
    body: ReadableStream.from([new TextEncoder().encode(text)]),
  });
  assert.equal((await readBody(streamed, { maxBytes: 5000 })).length, 5000);
  assert.equal((await readBody(new Request("http://x"), { maxBytes: 10 })).length, 0, "no body: empty");
  await assert.rejects(
    readBody(new Request("http://x", { method: "POST", body: text }), { maxBytes: 4999 }),
    (e: HttpError) => e.status === 413 && /exceeds 4999 bytes/.test(e.detail),
  );
});

Deno.test("readJsonBody() takes any spelling of a JSON media type, reads non-ASCII text, refuses the rest", async () => {
  const post = (type: string | null, body: string | Uint8Array<ArrayBuffer> = '{"a":"é€"}') =>
    readJsonBody(
      new Request("http://x", { method: "POST", body, headers: type === null ? {} : { "content-type": type } }),
      1024,
    );
  for (const type of ["application/json", "Application/JSON; charset=utf-8", " application/problem+json "]) {
    assert.deepEqual(await post(type), { a: "é€" }, type);
  }
  for (const type of [null, "text/plain", "application/jsonx"]) {
    await assert.rejects(post(type), (e: HttpError) => e.status === 415, String(type));
  }
  // The same decoder serves every request: a malformed body refuses that body only.
  await assert.rejects(
    post("application/json", new Uint8Array([0x7b, 0xff, 0x7d])),
    (e: HttpError) => e.status === 400,
  );
  assert.deepEqual(await post("application/json"), { a: "é€" });
});

Deno.test("readFormBody() parses a form within the limits and refuses anything else", async () => {
  const form = (body: string, type = "application/x-www-form-urlencoded") =>
    new Request("http://x", { method: "POST", headers: { "content-type": type }, body });
  const fields = await readFormBody(form("token=abc%20def&csrf=1"), { maxBytes: 100 });
  assert.equal(fields.get("token"), "abc def");
  await assert.rejects(
    readFormBody(form('{"token": "x"}', "application/json"), { maxBytes: 100 }),
    (e: HttpError) => e.status === 415,
  );
  await assert.rejects(
    readFormBody(form(`token=${"x".repeat(200)}`), { maxBytes: 100 }),
    (e: HttpError) => e.status === 413,
  );
  let timer: ReturnType<typeof setInterval> | undefined;
  const slow = new ReadableStream<Uint8Array>({
    start(controller) {
      timer = setInterval(() => controller.enqueue(new TextEncoder().encode("a")), 20);
    },
    cancel() {
      clearInterval(timer);
    },
  });
  const started = performance.now();
  await assert.rejects(
    readFormBody(
      new Request("http://x", {
        method: "POST",
        headers: { "content-type": "application/x-www-form-urlencoded" },
        body: slow,
      }),
      { maxBytes: 100, deadlineMs: 100 },
    ),
    (e: HttpError) => e.status === 408,
  );
  assert.ok(performance.now() - started < 1_000);
  clearInterval(timer);
});

Deno.test("duplicateKey finds a key twice in one object, after unescaping, at any depth and spacing", () => {
  assert.equal(duplicateKey('{"a":1,"b":{"a":2}}'), null, "the same name in two objects");
  assert.equal(duplicateKey('{"a":1,"a" \t\r\n:2}'), "a");
  assert.equal(duplicateKey('{"x":{"k":1,"\\u006b":2}}'), "k");
  assert.equal(duplicateKey('{"q\\"":1,"q\\u0022":2}'), 'q"');
  assert.equal(duplicateKey('{"a":"\\"a\\":1","b":["a","a"]}'), null, "strings and array items are not keys");
  assert.equal(duplicateKey('{"a\\\\":1,"a\\u005c":2}'), "a\\");
});
