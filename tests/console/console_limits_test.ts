/**
 * The console's sign-in form on a real API process (`main.ts api` with its
 * permission set and ADMIN_TOKEN), probed as a hostile client would: a
 * 200 MiB chunked form, watching the process's resident memory from outside
 * (`ps`), and a form dripped one byte a second.
 */
import assert from "node:assert/strict";
import { parseConfig } from "../../src/config.ts";
import { permissionFlags } from "../../src/permissions.ts";
import { createTestDatabase, freePort, REDIS_URL, waitFor } from "../_support.ts";
import { emptyRedisDatabase, releaseRedisDatabase } from "../support/scratch.ts";
import { rawConnect } from "../http/raw_client.ts";

const ROOT = decodeURIComponent(new URL("../..", import.meta.url).pathname);
const MIGRATIONS = decodeURIComponent(new URL("../../migrations/", import.meta.url).pathname);
const MIB = 1024 * 1024;

/** The process's resident set size in bytes, as `ps` reads it from /proc (which Deno opens only with -A). */
async function rss(pid: number): Promise<number> {
  const out = await new Deno.Command("ps", { args: ["-o", "rss=", "-p", String(pid)], stdout: "piped" }).output();
  const kib = Number(new TextDecoder().decode(out.stdout).trim());
  if (!out.success || !Number.isFinite(kib) || kib === 0) throw new Error(`ps could not read the RSS of ${pid}`);
  return kib * 1024;
}

Deno.test("the console's sign-in form on a real API: 413 at MAX_BODY_BYTES, 408 for a dripped body", async (t) => {
  const db = await createTestDatabase();
  // The API uses the service's fixed key names, so it gets a Redis database nobody else uses.
  const redisUrl = await emptyRedisDatabase(REDIS_URL);
  const port = freePort();
  const env = {
    DATABASE_URL: db.url,
    REDIS_URL: redisUrl,
    PORT: String(port),
    ADMIN_TOKEN: "limits-test-admin-token-0123456789",
    LOG_LEVEL: "warn",
    NO_COLOR: "1",
  };
  const flags = permissionFlags("api", parseConfig(env), MIGRATIONS);
  const api = new Deno.Command(Deno.execPath(), {
    args: ["run", ...flags, "main.ts", "api"],
    cwd: ROOT,
    env,
    stdout: "null",
    stderr: "piped",
  }).spawn();
  const stderr = new Response(api.stderr).text();
  const head = (length: string) =>
    `POST /console/login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n${length}\r\n\r\n`;
  try {
    await waitFor(
      "the API",
      () => fetch(`http://127.0.0.1:${port}/healthz`).then((r) => (r.body?.cancel(), r.ok), () => false),
      15_000,
    );
    // Warm up the path a sign-in takes, so the baseline is the working process, not a cold one.
    for (let i = 0; i < 5; i++) {
      const res = await fetch(`http://127.0.0.1:${port}/console/login`, {
        method: "POST",
        headers: { "content-type": "application/x-www-form-urlencoded" },
        body: "token=" + "w".repeat(20_000),
      });
      await res.body?.cancel();
    }

    await t.step("a 200 MiB chunked form is refused at MAX_BODY_BYTES; memory grows by less than 20 MiB", async () => {
      const before = await rss(api.pid);
      let peak = before;
      let sampling = true;
      const sampler = (async () => {
        while (sampling) {
          peak = Math.max(peak, await rss(api.pid));
          await new Promise((resolve) => setTimeout(resolve, 20));
        }
      })();
      const conn = await rawConnect(port);
      try {
        await conn.write(head("Transfer-Encoding: chunked"));
        await conn.write("4\r\ntok=\r\n");
        const piece = new Uint8Array(MIB).fill(0x61);
        const frame = new Uint8Array([...new TextEncoder().encode("100000\r\n"), ...piece, 13, 10]);
        let sent = 0;
        while (sent < 200 * MIB && await conn.write(frame)) sent += MIB;
        const answer = await conn.statusLine(10_000).catch((error: Error) => error);
        // Give a late allocation its chance to show.
        await new Promise((resolve) => setTimeout(resolve, 300));
        peak = Math.max(peak, await rss(api.pid));
        const grew = (peak - before) / MIB;
        console.log(
          `API RSS ${(before / MIB).toFixed(0)} MiB before, peak ${(peak / MIB).toFixed(0)} MiB; sent ${
            (sent / MIB).toFixed(0)
          } MiB`,
        );
        assert.ok(grew < 20, `RSS grew by ${grew.toFixed(1)} MiB`);
        if (answer instanceof Error) throw answer;
        assert.equal(answer.status, 413, conn.received.slice(0, 300));
        assert.match(conn.received, /exceeds 1048576 bytes/);
        assert.notEqual(await conn.closed(5_000), "open", "the connection is closed, not drained");
        assert.ok(sent < 200 * MIB, `the API stopped taking the body (after ${(sent / MIB).toFixed(0)} MiB)`);
      } finally {
        sampling = false;
        await sampler;
        conn.close();
      }
    });

    await t.step("a form dripped one byte a second gets 408 within 11 s, and the socket is then closed", async () => {
      const conn = await rawConnect(port);
      try {
        const started = performance.now();
        await conn.write(head("Content-Length: 100"));
        const drip = conn.drip("token=" + "x".repeat(94), 1_000);
        const { status, at } = await conn.statusLine(15_000);
        assert.equal(status, 408);
        assert.ok(at - started < 11_000, `408 after ${Math.round(at - started)} ms`);
        // Deno.serve lets go of the socket when its pending read of the body ends: at the next dripped byte.
        const closedAt = await conn.closed(3_000);
        drip.stop();
        assert.notEqual(closedAt, "open", "the socket is still open 3 s after the 408");
        console.log(
          `408 after ${Math.round(at - started)} ms; socket closed ${Math.round((closedAt as number) - at)} ms later`,
        );
        assert.ok(
          (closedAt as number) - at < 1_500,
          `closed ${Math.round((closedAt as number) - at)} ms after the 408`,
        );
      } finally {
        conn.close();
      }
    });
  } finally {
    api.kill("SIGTERM");
    const status = await api.status;
    const err = await stderr;
    await releaseRedisDatabase(redisUrl);
    await db.close();
    assert.equal(status.code, 0, err.slice(-1000));
  }
});
