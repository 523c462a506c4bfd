import assert from "node:assert/strict";
import { isRetryable, retryAfterMs } from "../../src/retry/classify.ts";
import { AttemptTimeout, ConnectionError, UpstreamHttpError } from "../../src/retry/errors.ts";
import { WebhookRefused, type WebhookUrlPolicy } from "../../src/webhooks/addresses.ts";
import { blankLineAt, postPinned, sendWebhook, type WebhookDelivery } from "../../src/webhooks/http_post.ts";
import { newWebhookSecret } from "../../src/webhooks/signature.ts";
import { type Receiver, startRawServer, startReceiver, verifyWebhook } from "./_receiver.ts";

const LOCAL: WebhookUrlPolicy = { allowHttp: true, allowPrivate: true };
const STRICT_BUT_HTTP: WebhookUrlPolicy = { allowHttp: true, allowPrivate: false };
const SECRET = newWebhookSecret();
const BODY = JSON.stringify({ type: "summary.done", job_id: "job_1" });

/** `hooks.test` resolves to loopback, as a tenant's name pointing at the receiver would. */
const resolveToLoopback = (host: string) => Promise.resolve(host === "hooks.test" ? ["127.0.0.1"] : []);

/** A delivery to `receiver` under the name hooks.test, with local addresses allowed. */
function deliveryTo(receiver: { port: number }, overrides: Partial<WebhookDelivery> = {}): WebhookDelivery {
  return {
    url: `http://hooks.test:${receiver.port}/hooks/oncely?tenant=t1`,
    policy: LOCAL,
    secrets: [SECRET],
    id: "msg_123",
    body: BODY,
    timeoutMs: 2_000,
    resolve: resolveToLoopback,
    ...overrides,
  };
}

async function withReceiver(
  answer: Parameters<typeof startReceiver>[0],
  run: (receiver: Receiver) => Promise<void>,
): Promise<void> {
  const receiver = startReceiver(answer);
  try {
    await run(receiver);
  } finally {
    await receiver.close();
  }
}

function upstream(status: number) {
  return (error: unknown) => {
    assert.ok(error instanceof UpstreamHttpError, `expected UpstreamHttpError, got ${error}`);
    assert.equal(error.status, status);
    return true;
  };
}

Deno.test("sendWebhook() posts a signed webhook the receiver verifies, once", async () => {
  await withReceiver(undefined, async (receiver) => {
    await sendWebhook(deliveryTo(receiver));
    assert.equal(receiver.requests.length, 1);
    const [request] = receiver.requests;
    assert.equal(request!.method, "POST");
    assert.equal(request!.url.pathname + request!.url.search, "/hooks/oncely?tenant=t1");
    assert.equal(request!.headers.get("host"), `hooks.test:${receiver.port}`);
    assert.equal(request!.headers.get("content-type"), "application/json");
    assert.equal(request!.headers.get("user-agent"), "Oncely-Webhooks/1");
    assert.equal(request!.headers.get("webhook-id"), "msg_123");
    assert.equal(request!.body, BODY);
    const nowSeconds = Math.floor(Date.now() / 1000);
    assert.ok(await verifyWebhook({ headers: request!.headers, body: request!.body, secret: SECRET, nowSeconds }));
    const other = newWebhookSecret();
    assert.equal(
      await verifyWebhook({ headers: request!.headers, body: request!.body, secret: other, nowSeconds }),
      false,
    );
  });
});

Deno.test("sendWebhook() stamps webhook-timestamp from the injected clock", async () => {
  await withReceiver(undefined, async (receiver) => {
    await sendWebhook(deliveryTo(receiver, { now: () => 1_700_000_000_999 }));
    const [request] = receiver.requests;
    assert.equal(request!.headers.get("webhook-timestamp"), "1700000000");
    assert.ok(
      await verifyWebhook({ headers: request!.headers, body: BODY, secret: SECRET, nowSeconds: 1_700_000_000 }),
    );
  });
});

Deno.test("sendWebhook() refuses a 302 and never follows it", async () => {
  await withReceiver(undefined, async (target) => {
    const location = `http://127.0.0.1:${target.port}/stolen`;
    await withReceiver(() => new Response(null, { status: 302, headers: { location } }), async (receiver) => {
      await assert.rejects(sendWebhook(deliveryTo(receiver)), (error) => {
        assert.ok(error instanceof WebhookRefused);
        assert.equal(error.message, "the receiver answered 302 (redirects are not followed)");
        assert.equal(isRetryable(error), false);
        return true;
      });
      assert.equal(receiver.requests.length, 1);
      assert.equal(target.requests.length, 0);
    });
  });
});

Deno.test("sendWebhook() turns a 503 into a retryable UpstreamHttpError carrying Retry-After", async () => {
  await withReceiver(() => new Response("busy", { status: 503, headers: { "retry-after": "7" } }), async (receiver) => {
    await assert.rejects(sendWebhook(deliveryTo(receiver)), (error) => {
      upstream(503)(error);
      assert.equal((error as UpstreamHttpError).headers.get("retry-after"), "7");
      assert.equal(isRetryable(error), true);
      assert.equal(retryAfterMs(error), 7_000);
      return true;
    });
    assert.equal(receiver.requests.length, 1);
  });
});

Deno.test("sendWebhook() turns a 429 into a retryable error and a 400 into a permanent one", async () => {
  await withReceiver(() => new Response(null, { status: 429 }), async (receiver) => {
    await assert.rejects(sendWebhook(deliveryTo(receiver)), (error) => upstream(429)(error) && isRetryable(error));
  });
  await withReceiver(() => new Response("bad", { status: 400 }), async (receiver) => {
    await assert.rejects(sendWebhook(deliveryTo(receiver)), (error) => upstream(400)(error) && !isRetryable(error));
  });
});

Deno.test("sendWebhook() fails permanently on a 409, which the shared classification would retry", async () => {
  await withReceiver(() => new Response(null, { status: 409 }), async (receiver) => {
    await assert.rejects(sendWebhook(deliveryTo(receiver)), (error) => {
      assert.ok(error instanceof WebhookRefused);
      assert.equal(isRetryable(error), false);
      assert.equal(((error as Error).cause as UpstreamHttpError).status, 409);
      return true;
    });
  });
});

Deno.test("sendWebhook() gives up with AttemptTimeout on a receiver that accepts and never answers", async () => {
  const server = startRawServer(async (_conn, closed) => await closed);
  try {
    const started = performance.now();
    await assert.rejects(sendWebhook(deliveryTo(server, { timeoutMs: 300 })), AttemptTimeout);
    const elapsed = performance.now() - started;
    assert.ok(elapsed >= 250 && elapsed < 1_300, `took ${elapsed} ms`);
    assert.equal(server.accepted, 1);
  } finally {
    await server.close();
  }
});

Deno.test("postPinned() stops reading a response head larger than maxHeadBytes", async () => {
  const huge = `HTTP/1.1 200 OK\r\nX-Filler: ${"a".repeat(100_000)}\r\n\r\n`;
  const server = startRawServer(async (conn, closed) => {
    await conn.read(new Uint8Array(4096));
    await conn.write(new TextEncoder().encode(huge));
    await closed; // keep the socket open: only the byte bound can end the read
  });
  try {
    const started = performance.now();
    await assert.rejects(sendWebhook(deliveryTo(server, { timeoutMs: 5_000 })), (error) => {
      assert.ok(error instanceof ConnectionError, `expected ConnectionError, got ${error}`);
      assert.match(error.message, /response head is larger than 16384 bytes/);
      assert.equal(isRetryable(error), true);
      return true;
    });
    assert.ok(performance.now() - started < 2_000);
  } finally {
    await server.close();
  }
});

Deno.test("postPinned() skips an interim 1xx head and returns the final status", async () => {
  const server = startRawServer(async (conn) => {
    await conn.read(new Uint8Array(4096));
    await conn.write(new TextEncoder().encode("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 202 Accepted\r\nX-Id: 9\r\n\r\n"));
  });
  try {
    const response = await postPinned({
      url: new URL(`http://hooks.test:${server.port}/`),
      address: "127.0.0.1",
      headers: {},
      body: "{}",
      timeoutMs: 2_000,
    });
    assert.equal(response.status, 202);
    assert.equal(response.headers.get("x-id"), "9");
  } finally {
    await server.close();
  }
});

Deno.test("postPinned() reads a head dripped a byte at a time, split CRLFs and a 1xx included", async () => {
  const head = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\nX-Id: 7\r\nX-Pad: " + "p".repeat(2_000) +
    "\r\n\r\n";
  const server = startRawServer(async (conn) => {
    await conn.read(new Uint8Array(4096));
    for (const byte of new TextEncoder().encode(head)) await conn.write(new Uint8Array([byte]));
  });
  try {
    const response = await postPinned({
      url: new URL(`http://hooks.test:${server.port}/`),
      address: "127.0.0.1",
      headers: {},
      body: "{}",
      timeoutMs: 10_000,
    });
    assert.equal(response.status, 204);
    assert.equal(response.headers.get("x-id"), "7");
  } finally {
    await server.close();
  }
});

Deno.test("blankLineAt() finds the end of a head in the bytes, starting where the last search stopped", () => {
  const bytes = new TextEncoder().encode("HTTP/1.1 200 OK\r\nA: b\r\n\r\nbody");
  const at = "HTTP/1.1 200 OK\r\nA: b".length;
  assert.equal(blankLineAt(bytes, 0, bytes.length), at);
  // A search may resume three bytes back, so a CRLF CRLF split across two reads is still found.
  assert.equal(blankLineAt(bytes, at - 3, at + 4), at);
  assert.equal(blankLineAt(bytes, 0, at + 3), -1, "not before all four bytes have arrived");
  assert.equal(blankLineAt(bytes, at + 1, bytes.length), -1);
});

Deno.test("sendWebhook() refuses a private address without allowPrivate and sends nothing", async () => {
  await withReceiver(undefined, async (receiver) => {
    await assert.rejects(
      sendWebhook(deliveryTo(receiver, { policy: STRICT_BUT_HTTP })),
      (error) =>
        error instanceof WebhookRefused &&
        /resolves to a private or loopback address \(127\.0\.0\.1\)/.test(error.message),
    );
    await assert.rejects(
      sendWebhook(deliveryTo(receiver, { policy: STRICT_BUT_HTTP, url: `http://127.0.0.1:${receiver.port}/` })),
      (error) => error instanceof WebhookRefused && /\(127\.0\.0\.1\)/.test(error.message),
    );
    assert.equal(receiver.requests.length, 0);
  });
});

Deno.test("sendWebhook() refuses http without allowHttp and sends nothing", async () => {
  await withReceiver(undefined, async (receiver) => {
    await assert.rejects(
      sendWebhook(deliveryTo(receiver, { policy: { allowHttp: false, allowPrivate: true } })),
      (error) => error instanceof WebhookRefused && /WEBHOOK_ALLOW_HTTP=true/.test(error.message),
    );
    assert.equal(receiver.requests.length, 0);
  });
});

Deno.test("sendWebhook() reports a refused connection as a retryable ConnectionError", async () => {
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const port = (listener.addr as Deno.NetAddr).port;
  listener.close();
  await assert.rejects(sendWebhook(deliveryTo({ port })), (error) => {
    assert.ok(error instanceof ConnectionError);
    assert.equal(isRetryable(error), true);
    assert.ok(!error.message.includes(SECRET.slice(6)));
    return true;
  });
});

Deno.test("postPinned() refuses a header value with CR or LF before connecting", async () => {
  await withReceiver(undefined, async (receiver) => {
    for (const value of ["a\r\nX-Injected: 1", "a\nb", "a\rb"]) {
      await assert.rejects(
        postPinned({
          url: new URL(`http://hooks.test:${receiver.port}/`),
          address: "127.0.0.1",
          headers: { "webhook-id": value },
          body: "{}",
          timeoutMs: 1_000,
        }),
        TypeError,
      );
    }
    await assert.rejects(
      postPinned({
        url: new URL(`http://hooks.test:${receiver.port}/`),
        address: "127.0.0.1",
        headers: { "Content-Length": "0" },
        body: "{}",
        timeoutMs: 1_000,
      }),
      TypeError,
    );
    assert.equal(receiver.requests.length, 0);
  });
});

Deno.test("sendWebhook() rejects with the caller's abort reason", async () => {
  const server = startRawServer(async (_conn, closed) => await closed);
  try {
    const controller = new AbortController();
    const reason = new Error("shutting down");
    setTimeout(() => controller.abort(reason), 50);
    await assert.rejects(sendWebhook(deliveryTo(server, { signal: controller.signal, timeoutMs: 5_000 })), (error) => {
      assert.equal(error, reason);
      return true;
    });
  } finally {
    await server.close();
  }
});

/** A CA and a leaf certificate for localhost and 127.0.0.1, signed by it; undefined without openssl. */
async function makeCertificates(): Promise<{ ca: string; cert: string; key: string } | undefined> {
  const dir = await Deno.makeTempDir({ prefix: "oncely_webhook_tls_" });
  const openssl = async (...args: string[]) => {
    const { success, stderr } = await new Deno.Command("openssl", { args, cwd: dir, stdout: "null", stderr: "piped" })
      .output();
    if (!success) throw new Error(`openssl ${args[0]} failed: ${new TextDecoder().decode(stderr)}`);
  };
  try {
    const ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    await openssl(
      "req",
      "-x509",
      ...ec,
      "-keyout",
      "ca.key",
      "-out",
      "ca.pem",
      "-days",
      "1",
      "-subj",
      "/CN=Oncely Test CA",
    );
    await openssl("req", "-new", ...ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=localhost");
    await Deno.writeTextFile(
      `${dir}/leaf.ext`,
      "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    await openssl(
      "x509",
      "-req",
      "-in",
      "leaf.csr",
      "-CA",
      "ca.pem",
      "-CAkey",
      "ca.key",
      "-CAcreateserial",
      "-out",
      "leaf.pem",
      "-days",
      "1",
      "-extfile",
      "leaf.ext",
    );
    return {
      ca: await Deno.readTextFile(`${dir}/ca.pem`),
      cert: await Deno.readTextFile(`${dir}/leaf.pem`),
      key: await Deno.readTextFile(`${dir}/leaf.key`),
    };
  } catch (error) {
    if (error instanceof Deno.errors.NotFound) return undefined;
    throw error;
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
}

const certificates = await makeCertificates();

Deno.test({
  name: "postPinned() verifies the receiver's certificate: untrusted fails, a trusted CA succeeds",
  ignore: certificates === undefined,
  async fn() {
    const { ca, cert, key } = certificates!;
    const receiver = startReceiver(undefined, { cert, key });
    try {
      const post = (caCerts?: string[]) =>
        postPinned({
          url: new URL(`https://localhost:${receiver.port}/hooks`),
          address: "127.0.0.1",
          headers: {},
          body: "{}",
          timeoutMs: 2_000,
          caCerts,
        });
      await assert.rejects(post(), (error) => {
        assert.ok(error instanceof ConnectionError, `expected ConnectionError, got ${error}`);
        assert.match(error.message, /TLS handshake with localhost failed: .*(certificate|UnknownIssuer)/i);
        return true;
      });
      assert.equal(receiver.requests.length, 0);
      assert.equal((await post([ca])).status, 204);
      assert.equal(receiver.requests.length, 1);
    } finally {
      await receiver.close();
    }
  },
});

Deno.test({
  name: "postPinned() checks the certificate against the URL's host name, not the address it connects to",
  ignore: certificates === undefined,
  async fn() {
    const { ca, cert, key } = certificates!;
    const receiver = startReceiver(undefined, { cert, key });
    try {
      await assert.rejects(
        postPinned({
          url: new URL(`https://hooks.test:${receiver.port}/`),
          address: "127.0.0.1",
          headers: {},
          body: "{}",
          timeoutMs: 2_000,
          caCerts: [ca],
        }),
        (error) => error instanceof ConnectionError && /TLS handshake with hooks\.test failed/.test(error.message),
      );
      assert.equal(receiver.requests.length, 0);
    } finally {
      await receiver.close();
    }
  },
});

Deno.test({
  name: "sendWebhook() delivers over https to a trusted receiver and the signature verifies",
  ignore: certificates === undefined,
  async fn() {
    const { ca, cert, key } = certificates!;
    const receiver = startReceiver(undefined, { cert, key });
    try {
      await sendWebhook(
        deliveryTo(receiver, { url: `https://localhost:${receiver.port}/hooks`, policy: LOCAL, caCerts: [ca] }),
      );
      const [request] = receiver.requests;
      const nowSeconds = Math.floor(Date.now() / 1000);
      assert.ok(await verifyWebhook({ headers: request!.headers, body: request!.body, secret: SECRET, nowSeconds }));
    } finally {
      await receiver.close();
    }
  },
});
