/**
 * Slow clients. `Deno.serve` bounds a request body (the API answers 408)
 * but has no option that bounds how long a client may take to send its
 * headers, so compose.yaml puts nginx in front. This runs that exact nginx
 * configuration (taken from compose.yaml, with the upstream and port
 * pointed at this test) against a real Deno.serve, and shows a client that
 * drips header bytes held open by Deno.serve alone and closed by the proxy.
 */
import assert from "node:assert/strict";
import { parse } from "npm:yaml@2.8.1";
import { freePort, waitFor } from "../_support.ts";

const compose = parse(await Deno.readTextFile(new URL("../../compose.yaml", import.meta.url)), { merge: true });

/** Opens a connection and sends one header byte every `everyMs`; resolves with how long the server kept it open. */
async function dripHeaders(port: number, everyMs: number, giveUpMs: number): Promise<number | "open"> {
  const conn = await Deno.connect({ hostname: "127.0.0.1", port });
  const started = performance.now();
  const encoder = new TextEncoder();
  let closed = false;
  const reader = (async () => {
    const buf = new Uint8Array(1024);
    try {
      while ((await conn.read(buf)) !== null) { /* a 408 page, then the close */ }
    } catch { /* reset */ }
    closed = true;
    return performance.now() - started;
  })();
  await conn.write(encoder.encode("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "));
  while (!closed && performance.now() - started < giveUpMs) {
    await new Promise((r) => setTimeout(r, everyMs));
    try {
      if (!closed) await conn.write(encoder.encode("a"));
    } catch {
      break; // the server closed it
    }
  }
  if (!closed) {
    conn.close();
    await reader;
    return "open";
  }
  return await reader;
}

Deno.test("the compose proxy closes a client that drips its headers; Deno.serve alone does not", async () => {
  const nginx = ["/usr/sbin/nginx", "/usr/bin/nginx"].find((p) => {
    try {
      return Deno.statSync(p).isFile;
    } catch {
      return false;
    }
  });
  assert.ok(nginx, "nginx is needed for this test (.ci/run installs Debian's nginx-light)");
  const api = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, () => new Response("ok"));
  const proxyPort = freePort();
  const dir = await Deno.makeTempDir();
  const conf: string = compose.services.proxy.environment.NGINX_CONF
    .replaceAll("$$", "$")
    .replace("proxy_pass http://api:8000;", `proxy_pass http://127.0.0.1:${api.addr.port};`)
    .replace("listen 8080;", `listen 127.0.0.1:${proxyPort};`);
  assert.match(conf, /client_header_timeout 10s;/);
  await Deno.writeTextFile(
    `${dir}/nginx.conf`,
    `daemon off;\nworker_processes 1;\npid ${dir}/nginx.pid;\nerror_log ${dir}/error.log;\n` +
      (Deno.uid() === 0 ? "user root;\n" : "") +
      `events { worker_connections 64; }\nhttp {\naccess_log off;\nclient_body_temp_path ${dir}/body;\n` +
      `proxy_temp_path ${dir}/proxy;\n${conf}\n}\n`,
  );
  const proxy = new Deno.Command(nginx, { args: ["-p", dir, "-c", `${dir}/nginx.conf`], stderr: "piped" }).spawn();
  try {
    await waitFor(
      "nginx",
      () => fetch(`http://127.0.0.1:${proxyPort}/healthz`).then((r) => r.text(), () => false),
      5_000,
    );
    const metrics = await fetch(`http://127.0.0.1:${proxyPort}/metrics`);
    await metrics.body?.cancel();
    assert.equal(metrics.status, 404, "the proxy keeps /metrics private");

    // One byte every 2 s: both run side by side, for at most 13 s.
    const [direct, proxied] = await Promise.all([
      dripHeaders(api.addr.port, 2_000, 13_000),
      dripHeaders(proxyPort, 2_000, 13_000),
    ]);
    assert.equal(direct, "open", "Deno.serve keeps a header-dripping client beyond 13 s (why the proxy exists)");
    assert.ok(typeof proxied === "number" && proxied < 12_000, `the proxy closed it after ${proxied} ms`);
  } finally {
    proxy.kill("SIGTERM");
    await proxy.status;
    await proxy.stderr.cancel();
    await api.shutdown();
    await Deno.remove(dir, { recursive: true });
  }
});
