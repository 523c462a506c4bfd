import assert from "node:assert/strict";
import {
  createTenantCache,
  IDLE_REFRESHES,
  READ_CHUNK,
  type TenantCacheOptions,
} from "../../src/tenants/tenant_cache.ts";
import { entryBytes } from "../../src/tenants/tenant_map.ts";

const tenant = (i: number) => `tenant-${i}`;

/**
 * A cache over `rows` (what Postgres holds: change it to change the truth) on a fake clock, recording each
 * read's keys; `fail` makes the next reads throw.
 */
function fixture(options: Partial<TenantCacheOptions<string>> = {}) {
  const rows = new Map<string, string>();
  const reads: string[][] = [];
  let t = 0;
  let fail = false;
  const cache = createTenantCache<string>({
    ttlMs: 10_000,
    now: () => t,
    read: async (keys) => {
      reads.push(keys);
      await Promise.resolve();
      if (fail) throw new Error("Postgres is down");
      return new Map(keys.filter((key) => rows.has(key)).map((key) => [key, rows.get(key)!]));
    },
    ...options,
  });
  return {
    cache,
    rows,
    reads,
    keysRead: () => reads.reduce((n, keys) => n + keys.length, 0),
    advance: (ms: number) => (t += ms),
    failReads: (on: boolean) => (fail = on),
  };
}

Deno.test("tenant cache: 25,000 tenants in use are each read once, together, then answered with no read", async () => {
  const { cache, rows, reads, keysRead } = fixture();
  for (let i = 0; i < 25_000; i++) rows.set(tenant(i), `v${i}`);
  const all = Array.from({ length: 25_000 }, (_, i) => tenant(i));
  const first = await Promise.all(all.map((key) => cache.get(key)));
  assert.deepEqual(first, all.map((_, i) => `v${i}`));
  assert.equal(keysRead(), 25_000, "each key read once");
  assert.ok(reads.length <= 26, `keys asked for together went in reads of up to ${READ_CHUNK} (${reads.length} reads)`);
  reads.length = 0;
  for (let round = 0; round < 3; round++) {
    for (const [i, key] of all.entries()) assert.equal(cache.peek(key)?.value, `v${i}`);
  }
  assert.equal(reads.length, 0, "warm: no read, where a cap of 10,000 entries made every other lookup one");
});

Deno.test("tenant cache: entries in use are read again in bulk every half TTL, so a change shows within it", async () => {
  const { cache, rows, reads, advance } = fixture();
  for (let i = 0; i < 2_500; i++) rows.set(tenant(i), "before");
  await Promise.all(Array.from({ length: 2_500 }, (_, i) => cache.get(tenant(i))));
  reads.length = 0;
  rows.set(tenant(7), "after");
  rows.delete(tenant(8)); // a revoked key, say
  // Every tenant used once a second for a minute: every answer is at once, and at most ttlMs old.
  for (let second = 1; second <= 60; second++) {
    advance(1_000);
    for (let i = 0; i < 2_500; i++) {
      const hit = cache.peek(tenant(i));
      // A key found absent is not read in bulk: once its absence is ttlMs old, a request reads it again.
      if (i === 8 && second >= 10) assert.equal(hit?.value, undefined, "the row's absence showed within the TTL");
      else assert.ok(hit, `${tenant(i)} answered without a read at ${second} s`);
      if (second >= 10 && i === 7) assert.equal(hit!.value, "after", "the change showed within the TTL");
    }
    await cache.settled();
  }
  assert.ok(reads.every((keys) => keys.length <= READ_CHUNK));
  // 2,500 keys every 5 s: 12 bulk reads of three queries each.
  assert.equal(reads.length, 12 * 3, `one query per ${READ_CHUNK} keys per half TTL (${reads.length} queries)`);
});

Deno.test("tenant cache: no read older than ttlMs answers, even when the bulk reads fail", async () => {
  const { cache, rows, reads, advance, failReads } = fixture();
  rows.set("acme", "v1");
  assert.equal(await cache.get("acme"), "v1");
  failReads(true);
  advance(5_000);
  assert.equal(cache.peek("acme")?.value, "v1", "still within the TTL (and the bulk read starts)");
  await cache.settled();
  assert.equal(reads.length, 2);
  advance(5_000);
  assert.equal(cache.peek("acme"), undefined, "a read ttlMs old no longer answers");
  await assert.rejects(cache.get("acme"), /Postgres is down/, "the request's own read fails: its caller says so");
  failReads(false);
  rows.set("acme", "v2");
  assert.equal(await cache.get("acme"), "v2");
});

Deno.test("tenant cache: after a pause past the TTL, the first old entry asked for starts one bulk read of all", async () => {
  const { cache, rows, reads, advance } = fixture();
  for (let i = 0; i < 2_500; i++) rows.set(tenant(i), "v");
  await Promise.all(Array.from({ length: 2_500 }, (_, i) => cache.get(tenant(i))));
  reads.length = 0;
  advance(60_000);
  const again = await Promise.all(Array.from({ length: 2_500 }, (_, i) => cache.get(tenant(i))));
  assert.ok(again.every((value) => value === "v"));
  await cache.settled();
  const keys = reads.flat();
  assert.equal(new Set(keys).size, keys.length, "no key read twice");
  assert.equal(keys.length, 2_500);
  assert.ok(reads.length <= 5, `read together, not one by one (${reads.length} reads)`);
});

Deno.test("tenant cache: an entry idle across IDLE_REFRESHES bulk reads is dropped, not read again", async () => {
  const { cache, rows, reads, advance } = fixture();
  rows.set("busy", "v").set("gone-quiet", "v");
  await cache.get("busy");
  await cache.get("gone-quiet");
  reads.length = 0;
  for (let i = 0; i < IDLE_REFRESHES + 2; i++) {
    advance(5_000);
    assert.ok(cache.peek("busy"));
    await cache.settled();
  }
  assert.ok(reads.slice(0, IDLE_REFRESHES).every((keys) => keys.includes("gone-quiet")));
  assert.deepEqual(reads.at(-1), ["busy"], "only the tenant in use is read in bulk now");
  assert.equal(cache.peek("gone-quiet"), undefined);
});

Deno.test("tenant cache: keys not found are kept apart within their bound, and a flood of them evicts no key in use", async () => {
  const { cache, rows, reads } = fixture({ absentBytes: entryBytes(tenant(99_999)) * 100 });
  rows.set("acme", "v");
  await cache.get("acme");
  for (let i = 0; i < 5_000; i++) assert.equal(await cache.get(tenant(i)), undefined);
  assert.equal(reads.length, 5_001, "one read per invented key");
  assert.equal(await cache.get(tenant(4_999)), undefined);
  assert.equal(reads.length, 5_001, "a recent invented key is answered from its part");
  assert.equal(await cache.get(tenant(0)), undefined);
  assert.equal(reads.length, 5_002, "an old one was dropped: its part holds about 100");
  assert.equal(cache.peek("acme")?.value, "v", "the key in use was never evicted");
});

Deno.test("tenant cache: with absentBytes 0, a key not found is read each time, and found once it exists", async () => {
  const { cache, rows, reads } = fixture({ absentBytes: 0 });
  assert.equal(await cache.get("acme"), undefined);
  assert.equal(await cache.get("acme"), undefined);
  assert.equal(reads.length, 2);
  rows.set("acme", "v");
  assert.equal(await cache.get("acme"), "v");
  assert.equal(await cache.get("acme"), "v");
  assert.equal(reads.length, 3);
});

Deno.test("tenant cache: merge carries what the caller added to a value into the value read again", async () => {
  let t = 0;
  let row = "row 1";
  const cache = createTenantCache<{ row: string; seen?: boolean }>({
    ttlMs: 10_000,
    now: () => t,
    read: (keys) => Promise.resolve(new Map(keys.map((key) => [key, { row }]))),
    merge: (before, after) => ({ ...after, seen: before.seen }),
  });
  const first = (await cache.get("acme"))!;
  first.seen = true;
  row = "row 2";
  t += 10_000;
  assert.deepEqual(await cache.get("acme"), { row: "row 2", seen: true });
  assert.deepEqual(cache.peek("acme")?.value, { row: "row 2", seen: true });
});

Deno.test("tenant cache: with a process's signal, a timer reads the entries again through a pause in requests", async () => {
  const rows = new Map([["acme", "v1"]]);
  let reads = 0;
  const stop = new AbortController();
  const cache = createTenantCache<string>({
    ttlMs: 200,
    signal: stop.signal,
    read: (keys) => {
      reads++;
      return Promise.resolve(new Map(keys.filter((key) => rows.has(key)).map((key) => [key, rows.get(key)!])));
    },
  });
  try {
    assert.equal(await cache.get("acme"), "v1");
    rows.set("acme", "v2");
    // Three TTLs with no request: the timer's bulk reads keep the entry fresh, and bring the change.
    await new Promise((resolve) => setTimeout(resolve, 600));
    assert.equal(cache.peek("acme")?.value, "v2", "fresh after the pause, without a read of its own");
    assert.ok(reads >= 3, `read again by the timer (${reads} reads)`);
  } finally {
    stop.abort();
    await cache.settled();
  }
});
