import assert from "node:assert/strict";
import { ENTRY_OVERHEAD_BYTES, entryBytes, TenantMap } from "../../src/tenants/tenant_map.ts";

const tenant = (i: number) => `tenant-${String(i).padStart(6, "0")}`;

Deno.test("TenantMap holds entries up to its bound in bytes, whatever their count", () => {
  const each = entryBytes(tenant(0));
  const map = new TenantMap<true>(each * 25_000);
  for (let i = 0; i < 25_000; i++) map.set(tenant(i), true);
  assert.equal(map.size, 25_000, "25,000 tenants fit a bound of 25,000 entries' bytes: no cap on the count");
  assert.equal(map.bytes, each * 25_000);
  for (let i = 0; i < 25_000; i++) assert.equal(map.get(tenant(i)), true);
});

Deno.test("TenantMap drops its oldest entries first past its bound, and never holds more than it", () => {
  const each = entryBytes(tenant(0));
  const map = new TenantMap<true>(each * 1_000);
  // Many rounds of eviction, with deletions here and there: the bound and the order hold throughout.
  for (let i = 0; i < 100_000; i++) {
    map.set(tenant(i), true);
    if (i % 7 === 0) map.delete(tenant(i - 3));
    assert.ok(map.bytes <= map.maxBytes);
  }
  assert.equal(map.bytes, map.size * each);
  for (let i = 99_000; i < 100_000; i++) {
    if (i % 7 !== 4) assert.equal(map.get(tenant(i)), true, `recent ${tenant(i)} kept`);
  }
  assert.equal(map.get(tenant(98_000)), undefined, "an old one dropped");
  map.set(tenant(1), true);
  assert.equal(map.get(tenant(1)), true, "a dropped key stored again is the newest");
});

Deno.test("TenantMap weighs values: a heavier value counts more, in place, and one over the bound is not kept", () => {
  const map = new TenantMap<string>(entryBytes("a", 100) * 3, (value) => value.length);
  map.set("a", "x".repeat(10));
  map.set("b", "x".repeat(10));
  assert.equal(map.bytes, 2 * entryBytes("a", 10));
  map.set("a", "x".repeat(100));
  assert.equal(map.bytes, entryBytes("a", 100) + entryBytes("b", 10), "the value replaced where it was");
  map.set("c", "x".repeat(100));
  map.set("d", "x".repeat(100));
  assert.equal(map.get("a"), undefined, "the oldest went to make room");
  assert.ok(map.bytes <= map.maxBytes);
  map.set("b", "x".repeat(10_000));
  assert.equal(map.get("b"), undefined, "a value heavier than the bound replaces nothing and is not kept");
  assert.ok(map.bytes <= map.maxBytes);
  assert.throws(() => new TenantMap(ENTRY_OVERHEAD_BYTES - 1), RangeError);
});
