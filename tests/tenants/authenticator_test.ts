import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { createAuthenticator } from "../../src/tenants/authenticator.ts";
import { createApiKey, revokeTenant } from "../../src/tenants/tenant_store.ts";
import { countingSql, createTestDatabase, waitFor } from "../_support.ts";
import { entryBytes } from "../../src/tenants/tenant_map.ts";

Deno.test("API-key lookups: unknown ids are cached apart and a flood of them never evicts a good key", async () => {
  const db = await createTestDatabase();
  try {
    const { sql: counting, queries } = countingSql(db.sql);
    // Room for about ten unknown ids (each about 200 bytes by the cache's estimate), on a clock that stands still.
    const auth = createAuthenticator({ sql: counting }, {
      mode: "api-key",
      absentCacheBytes: entryBytes("0123456789ab") * 10,
      cacheTtlMs: 60_000,
      now: () => 0,
    });
    const good = await createApiKey(db.sql, "acme");
    const as = (key: string) => auth(new Request("http://api/", { headers: { authorization: `Bearer ${key}` } }));
    assert.equal(await as(good), "acme");
    assert.equal(queries(), 1);
    const invented = () => `onc_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}_${"A".repeat(43)}`;
    const flood = Array.from({ length: 50 }, invented);
    for (const key of flood) await assert.rejects(as(key), /not valid/);
    assert.equal(queries(), 51, "one query per unknown id");
    await assert.rejects(as(flood[49]!), /not valid/);
    assert.equal(queries(), 51, "a repeated unknown id is answered from its cache");
    assert.equal(await as(good), "acme");
    assert.equal(queries(), 51, "the good key was not evicted by 50 misses in a cache of 10");
  } finally {
    await db.close();
  }
});

/** An authenticator on a fake clock, and a way to ask it for a key's tenant. */
function clocked(sql: Sql, cacheTtlMs: number) {
  let t = 0;
  const { sql: counting, queries } = countingSql(sql);
  const auth = createAuthenticator({ sql: counting }, { mode: "api-key", cacheTtlMs, now: () => t });
  return {
    as: (authorization: string) => auth(new Request("http://api/", { headers: { authorization } })),
    advance: (ms: number) => (t += ms),
    queries,
  };
}

Deno.test("a revoked key stops working once its cached row is cacheTtlMs old, however often it was used", async () => {
  const db = await createTestDatabase();
  try {
    const { as, advance, queries } = clocked(db.sql, 10_000);
    const key = await createApiKey(db.sql, "acme");
    assert.equal(await as(`Bearer ${key}`), "acme");
    for (let i = 0; i < 20; i++) assert.equal(await as(`Bearer ${key}`), "acme");
    assert.equal(queries(), 1, "answered from the cache");
    await revokeTenant(db.sql, "acme");
    advance(9_999);
    assert.equal(await as(`Bearer ${key}`), "acme", "within the TTL the cached row still answers (documented)");
    advance(2);
    await assert.rejects(as(`Bearer ${key}`), /not valid/);
    await assert.rejects(as(`Bearer ${key}`), /not valid/);
    assert.equal(queries(), 2, "the row was read again once, then its absence cached");
  } finally {
    await db.close();
  }
});

Deno.test("a key verified before stays valid each time its row is read again, once per cacheTtlMs", async () => {
  const db = await createTestDatabase();
  try {
    const { as, advance, queries } = clocked(db.sql, 1_000);
    const key = await createApiKey(db.sql, "acme");
    for (let i = 0; i < 5; i++) {
      assert.equal(await as(`Bearer ${key}`), "acme");
      advance(1_001);
    }
    assert.equal(queries(), 5, "one read per TTL");
  } finally {
    await db.close();
  }
});

Deno.test("a wrong secret for a known, verified id is never accepted, in any spelling", async () => {
  const db = await createTestDatabase();
  try {
    const { as } = clocked(db.sql, 60_000);
    const key = await createApiKey(db.sql, "acme");
    const other = await createApiKey(db.sql, "other");
    assert.equal(await as(`Bearer ${key}`), "acme");
    const [, id, secret] = /^onc_([0-9a-f]{12})_(.+)$/.exec(key)!;
    const flip = (c: string) => (c === "A" ? "B" : "A");
    const wrong = [
      // Every single-character change of the secret, at every place.
      ...[...secret!].map((c, i) => `onc_${id}_${secret!.slice(0, i)}${flip(c)}${secret!.slice(i + 1)}`),
      `onc_${id}_${/^onc_[0-9a-f]{12}_(.+)$/.exec(other)![1]}`, // another tenant's secret
      `onc_${id}_${secret!.slice(0, -1)}`,
      `onc_${id}_${secret}A`,
      `onc_${id}_${secret!.toUpperCase() === secret ? secret!.toLowerCase() : secret!.toUpperCase()}`,
    ];
    for (const presented of wrong) {
      for (const spelling of [`Bearer ${presented}`, `bearer  ${presented} `]) {
        await assert.rejects(as(spelling), /not valid|malformed/, spelling);
      }
    }
    // Other spellings of the right key are the same key; the key itself still works.
    assert.equal(await as(`bearer   ${key}  `), "acme");
    assert.equal(await as(`Bearer ${key}`), "acme");
    assert.equal(await as(`Bearer ${other}`), "other");
    await assert.rejects(as(`Bearer ${key} extra`), /malformed/);
    await assert.rejects(as(`Basic ${key}`), /malformed/);
  } finally {
    await db.close();
  }
});

Deno.test("a revoked key in constant use stops within cacheTtlMs through the bulk read, no request waiting on a read", async () => {
  const db = await createTestDatabase();
  try {
    const { as, advance, queries } = clocked(db.sql, 10_000);
    const key = await createApiKey(db.sql, "acme");
    assert.equal(await as(`Bearer ${key}`), "acme");
    advance(2_000);
    assert.equal(await as(`Bearer ${key}`), "acme");
    await revokeTenant(db.sql, "acme");
    // Half the TTL on: this request is answered from the cache, and starts the bulk read of the keys in use.
    advance(3_000);
    assert.equal(await as(`Bearer ${key}`), "acme");
    await waitFor("the bulk read to find the key revoked", () => as(`Bearer ${key}`).then(() => false, () => true));
    assert.equal(queries(), 2, "the first read and the bulk read: no request read the row itself");
  } finally {
    await db.close();
  }
});

Deno.test("trusted-header mode: 12,000 tenants are read in bulk, then answered from the cache alone", async () => {
  const db = await createTestDatabase();
  try {
    await db.sql`INSERT INTO tenants (name) SELECT 'lane-' || i FROM generate_series(1, 12000) AS i`;
    await db.sql`
      INSERT INTO api_keys (id, tenant, secret_sha256)
      SELECT lpad(to_hex(i), 12, '0'), 'lane-' || i, '\\x00'::bytea FROM generate_series(1, 12000) AS i`;
    await db.sql`UPDATE api_keys SET revoked_at = now() WHERE tenant = 'lane-12000'`;
    const { sql: counting, queries } = countingSql(db.sql);
    const secret = "gateway-secret-0123456789";
    const auth = createAuthenticator({ sql: counting }, {
      mode: "trusted-header",
      gatewaySecret: secret,
      now: () => 0,
    });
    const as = (tenant: string) =>
      auth(new Request("http://x", { headers: { "x-gateway-secret": secret, "x-tenant-id": tenant } }))
        .then(() => true, () => false);
    const tenants = Array.from({ length: 12_000 }, (_, i) => `lane-${i + 1}`);
    const first = await Promise.all(tenants.map(as));
    assert.equal(first.filter(Boolean).length, 11_999, "every active tenant, and not the revoked one");
    assert.ok(queries() <= 20, `tenants asked for together were read together (${queries()} queries)`);
    const before = queries();
    const again = await Promise.all(tenants.map(as));
    assert.deepEqual(again, first);
    assert.equal(queries(), before, "no query once warm (a cap of 10,000 entries read each of them again)");
  } finally {
    await db.close();
  }
});
