/**
 * The tenant change log (migration 022) and the caches that confirm their
 * entries through it instead of reading every one again (issue 39): each
 * change a cache reads from is logged, a change whose transaction spans a
 * look is still seen by the next, a changed tenant's entry is dropped at the
 * next pass, an entry the log cannot vouch for is read again, and the log's
 * old rows go with retention.
 */
import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { createApiKey, revokeTenant } from "../../src/tenants/tenant_store.ts";
import { allowValue } from "../../src/tenants/allow_list.ts";
import { MAIL_DOMAINS } from "../../src/tenants/mail_domains.ts";
import { WEBHOOK_HOSTS } from "../../src/tenants/webhook_hosts.ts";
import { ensureWebhookSecret, rotateWebhookSecret } from "../../src/tenants/webhook_secrets.ts";
import {
  CHANGES_KEPT_MS,
  deleteOldChanges,
  parseSnapshot,
  type Snapshot,
  type TenantChangeFeed,
  tenantChangeFeed,
  visibleIn,
} from "../../src/tenants/tenant_changes.ts";
import { createTenantCache } from "../../src/tenants/tenant_cache.ts";
import { createAuthenticator } from "../../src/tenants/authenticator.ts";
import { countingSql, createTestDatabase, waitFor } from "../_support.ts";

Deno.test("parseSnapshot() reads pg_snapshot's text and visibleIn() judges a transaction as Postgres does", () => {
  const s = parseSnapshot("100:105:100,103");
  assert.deepEqual([s.xmin, s.xmax, [...s.xip], s.text], [100n, 105n, [100n, 103n], "100:105:100,103"]);
  assert.equal(visibleIn(99n, s), true, "ended before the snapshot");
  assert.equal(visibleIn(100n, s), false, "in progress");
  assert.equal(visibleIn(101n, s), true, "between, not in progress: ended");
  assert.equal(visibleIn(103n, s), false);
  assert.equal(visibleIn(105n, s), false, "not started");
  assert.deepEqual([...parseSnapshot("7:7:").xip], []);
  assert.throws(() => parseSnapshot("7:x:"), /Not a pg_snapshot/);
});

/** Runs `body` with a migrated database and its change feed. */
async function withFeed(body: (sql: Sql, feed: TenantChangeFeed) => Promise<void>) {
  const db = await createTestDatabase();
  try {
    await body(db.sql, tenantChangeFeed(db.sql));
  } finally {
    await db.close();
  }
}

Deno.test("tenant change log: every change a cache reads from names its tenant, and only its tenant", async () => {
  await withFeed(async (sql, feed) => {
    await createApiKey(sql, "other");
    const changedBy = async (change: () => Promise<unknown>) => {
      const { snapshot } = await feed();
      await change();
      return [...(await feed(snapshot)).tenants!].sort();
    };
    assert.deepEqual(await changedBy(() => createApiKey(sql, "acme")), ["acme"], "a new key (and tenant)");
    assert.deepEqual(await changedBy(() => createApiKey(sql, "acme")), ["acme"], "a second key");
    assert.deepEqual(await changedBy(() => allowValue(sql, MAIL_DOMAINS, "acme", "acme.test")), ["acme"]);
    assert.deepEqual(await changedBy(() => allowValue(sql, MAIL_DOMAINS, "acme", null)), ["acme"], "a list emptied");
    assert.deepEqual(await changedBy(() => allowValue(sql, WEBHOOK_HOSTS, "acme", "hooks.acme.test")), ["acme"]);
    assert.deepEqual(await changedBy(() => ensureWebhookSecret(sql, "acme")), ["acme"]);
    assert.deepEqual(await changedBy(() => rotateWebhookSecret(sql, "acme")), ["acme"]);
    assert.deepEqual(await changedBy(() => revokeTenant(sql, "acme")), ["acme"], "keys revoked");
    assert.deepEqual(await changedBy(() => sql`SELECT 1`), [], "nothing changed");
    const { snapshot } = await feed();
    assert.deepEqual([...(await feed(snapshot)).tenants!], [], "a look sees nothing its own snapshot saw");
  });
});

Deno.test("tenant change log: a change whose transaction was open during a look is seen by the next look", async () => {
  await withFeed(async (sql, feed) => {
    await createApiKey(sql, "acme");
    const before = (await feed()).snapshot;
    const tx = await sql.reserve();
    try {
      await tx`BEGIN`;
      await tx`INSERT INTO tenant_mail_domains (tenant, domain) VALUES ('acme', 'acme.test')`;
      // The look runs while the change is written and not committed: it cannot see it, nor list it.
      const during = await feed(before);
      assert.deepEqual([...during.tenants!], []);
      await tx`COMMIT`;
      // A sequence or a timestamp taken at the write would fall before `during` and be skipped from here on.
      assert.deepEqual([...(await feed(during.snapshot)).tenants!], ["acme"], "the next look lists it");
      const after = await feed(during.snapshot);
      assert.deepEqual([...(await feed(after.snapshot)).tenants!], [], "and the one after that no more");
    } finally {
      tx.release();
    }
  });
});

Deno.test("tenant change log: retention deletes the rows of transactions that had ended an hour before", async () => {
  await withFeed(async (sql) => {
    await createApiKey(sql, "old");
    // A pass an hour ago recorded the oldest transaction running then; the rows below it go.
    const olderRows = async () =>
      (await sql<{ n: number }[]>`
        SELECT count(*)::int AS n FROM tenant_changes
        WHERE xid < (SELECT max(oldest_running) FROM tenant_change_horizons WHERE at < now() - interval '1 hour')`)[0]!
        .n;
    // A transaction open elsewhere on the server (another test's) holds the horizon back until it ends.
    await waitFor("a horizon above the old tenant's rows", async () => {
      await sql`
        INSERT INTO tenant_change_horizons (at, oldest_running)
        VALUES (now() - interval '2 hours' + random() * interval '1 second', pg_snapshot_xmin(pg_current_snapshot()))`;
      return (await olderRows()) === 2;
    });
    // A transaction that began three hours ago and committed just now: its row stays, whatever its age.
    await sql`INSERT INTO tenant_changes (tenant) VALUES ('late')`;
    await createApiKey(sql, "new");
    assert.equal(await deleteOldChanges(sql, { limit: 1_000 }), 2, "the old tenant's key and tenant rows");
    const left = await sql<{ tenant: string }[]>`SELECT tenant FROM tenant_changes ORDER BY xid`;
    assert.deepEqual(left.map((r) => r.tenant), ["late", "new", "new"]);
    assert.equal(await deleteOldChanges(sql, { olderThanMs: CHANGES_KEPT_MS, limit: 1_000 }), 0);
    const horizons = await sql`SELECT at FROM tenant_change_horizons WHERE at < now() - interval '1 hour'`;
    assert.equal(horizons.length, 1, "only the newest horizon old enough is kept, and this pass's own");
  });
});

Deno.test("tenant change log: a renamed tenant and a truncated table are changes too", async () => {
  await withFeed(async (sql, feed) => {
    await sql`INSERT INTO tenants (name) VALUES ('solo')`;
    await ensureWebhookSecret(sql, "solo");
    let { snapshot } = await feed();
    await sql`UPDATE tenants SET name = 'renamed' WHERE name = 'solo'`;
    assert.deepEqual([...(await feed(snapshot)).tenants!].sort(), ["renamed", "solo"]);
    ({ snapshot } = await feed());
    await sql`TRUNCATE tenant_webhook_hosts`;
    assert.equal((await feed(snapshot)).tenants, null, "every tenant may have changed");
  });
});

/** A cache of tenants' mail-domain counts over `sql`, on a fake clock, counting the keys each read asked for. */
function domainCounts(sql: Sql, changes: TenantChangeFeed | undefined) {
  let t = 0;
  let keysRead = 0;
  const cache = createTenantCache<number>({
    ttlMs: 10_000,
    now: () => t,
    changes,
    read: async (tenants) => {
      keysRead += tenants.length;
      const rows = await sql<{ tenant: string; n: number }[]>`
        SELECT t.name AS tenant, count(d.domain)::int AS n FROM tenants t
        LEFT JOIN tenant_mail_domains d ON d.tenant = t.name WHERE t.name = ANY(${tenants}) GROUP BY t.name`;
      return new Map(rows.map((r) => [r.tenant, r.n]));
    },
  });
  return {
    cache,
    keysRead: () => keysRead,
    advance: (ms: number) => (t += ms),
    /** Advances to the next pass, starts it with a peek, and waits for it. */
    async pass(key: string) {
      t += 5_000;
      cache.peek(key);
      await cache.settled();
    },
  };
}

Deno.test("tenant cache with the change log: a pass reads no unchanged entry, and a changed tenant's is read anew", async () => {
  await withFeed(async (sql, feed) => {
    const names = Array.from({ length: 2_000 }, (_, i) => `t${i}`);
    await sql`INSERT INTO tenants ${sql(names.map((name) => ({ name })))}`;
    const { cache, keysRead, advance, pass } = domainCounts(sql, feed);
    await cache.settled(); // the first look, so the first reads have a snapshot to be confirmed against
    await Promise.all(names.map((name) => cache.get(name)));
    assert.equal(keysRead(), 2_000);
    // A minute of passes with every tenant in use: no entry read again, every one answered (well past the TTL).
    for (let second = 5; second <= 60; second += 5) {
      await pass("t0");
      for (const name of names) assert.equal(cache.peek(name)?.value, 0, `${name} at ${second} s`);
    }
    assert.equal(keysRead(), 2_000, "no read after the first: every pass confirmed the entries through the log");

    await allowValue(sql, MAIL_DOMAINS, "t7", "t7.test");
    await pass("t0");
    assert.equal(cache.peek("t7"), undefined, "the changed tenant's entry is dropped at the next pass");
    assert.equal(cache.peek("t8")?.value, 0, "the others kept");
    assert.equal(await cache.get("t7"), 1, "and read anew at its next use");
    assert.equal(keysRead(), 2_001);

    // A pause longer than half the log's lifetime: the log may have lost rows, so everything is read again.
    advance(CHANGES_KEPT_MS / 2);
    await cache.get("t0"); // every entry too old now: a look that starts afresh, and the bulk read of every entry
    await cache.settled();
    const after = keysRead();
    assert.ok(after - 2_001 >= 2_000 && after - 2_001 <= 2_001, `every entry read again (${after - 2_001})`);
    for (const name of names) assert.equal(cache.peek(name)?.value, name === "t7" ? 1 : 0);
    // t0's own read went out before that look was answered: the log vouches for it only after its own re-read.
    await pass("t0");
    assert.ok(keysRead() - after <= 1);
    const settledAt = keysRead();
    await pass("t0");
    await pass("t0");
    assert.equal(keysRead(), settledAt, "then the log vouches again");
  });
});

Deno.test("tenant cache with the change log: without it, every pass reads every entry again", async () => {
  await withFeed(async (sql) => {
    await sql`INSERT INTO tenants ${sql([{ name: "a" }, { name: "b" }])}`;
    const { cache, keysRead, pass } = domainCounts(sql, undefined);
    await Promise.all(["a", "b"].map((name) => cache.get(name)));
    await pass("a");
    await pass("a");
    assert.equal(keysRead(), 2 + 2 + 2, "the bulk reads the log replaces");
  });
});

Deno.test("tenant cache with the change log: an entry read before a look was answered is read again, not confirmed", async () => {
  // A fake log: snapshots count up, nothing ever changes.
  let n = 10n;
  const feed: TenantChangeFeed = () => {
    const snapshot: Snapshot = { xmin: n, xmax: n, xip: new Set(), text: `${n}:${n}:` };
    n++;
    return Promise.resolve({ snapshot, tenants: new Set<string>() });
  };
  let t = 0;
  const reads: string[][] = [];
  let hold: PromiseWithResolvers<void> | undefined;
  const cache = createTenantCache<string>({
    ttlMs: 10_000,
    now: () => t,
    changes: feed,
    read: async (keys) => {
      reads.push(keys);
      if (hold) await hold.promise;
      return new Map(keys.map((k) => [k, `v-${k}`]));
    },
  });
  await cache.settled();
  assert.equal(await cache.get("a"), "v-a");
  // b's read is sent, then a look is sent and answered while b's read is still out: b's value may predate a
  // change that look saw, so the look after it cannot vouch for b.
  hold = Promise.withResolvers();
  const b = cache.get("b");
  t += 5_000;
  cache.peek("a");
  await new Promise((r) => setTimeout(r, 0));
  hold.resolve();
  hold = undefined;
  assert.equal(await b, "v-b");
  await cache.settled();
  reads.length = 0;
  t += 5_000;
  cache.peek("a");
  await cache.settled();
  assert.deepEqual(reads, [["b"]], "b alone is read again; a is confirmed");
  t += 5_000;
  cache.peek("a");
  await cache.settled();
  assert.deepEqual(reads, [["b"]], "and from then on b is confirmed too");
});

Deno.test("authenticator with the change log: a revoked key stops working at the next pass, with no bulk re-read", async () => {
  await withFeed(async (sql, feed) => {
    let t = 0;
    const { sql: counting, queries } = countingSql(sql);
    // The last look the cache sent: once it has settled, so has the cache's handling of it (attached first).
    let look: Promise<unknown> = Promise.resolve();
    const changes: TenantChangeFeed = (since) => {
      const p = feed(since);
      look = p;
      return p;
    };
    const looked = () => look.then(() => {}, () => {});
    // Both keys exist before the first look: one made after it would be a change the first pass drops.
    const acme = await createApiKey(sql, "acme");
    const globex = await createApiKey(sql, "globex");
    const auth = createAuthenticator({ sql: counting }, { mode: "api-key", cacheTtlMs: 10_000, now: () => t, changes });
    const as = (key: string) => auth(new Request("http://api/", { headers: { authorization: `Bearer ${key}` } }));
    await looked(); // the first look
    assert.equal(await as(acme), "acme");
    assert.equal(await as(globex), "globex");
    const read = queries();
    for (let i = 0; i < 4; i++) {
      t += 5_000;
      assert.equal(await as(acme), "acme"); // starts the pass
      assert.equal(await as(globex), "globex");
      await looked();
    }
    assert.equal(queries(), read, "passes read no key row again, and both entries stay well past the TTL");
    await revokeTenant(sql, "acme");
    t += 5_000;
    assert.equal(await as(globex), "globex"); // starts the pass
    await looked();
    // The clock stands 5 s after acme's last confirmation: without the log, its row would answer for 5 s more.
    await assert.rejects(as(acme), /not valid/, "revoked within one pass, not a whole TTL");
    assert.equal(await as(globex), "globex");
  });
});

Deno.test("tenant cache with the change log: a request after a look reported its tenant changed does not join an older read", async () => {
  let calls = 0;
  let n = 10n;
  const feed: TenantChangeFeed = () => {
    calls++;
    const snapshot: Snapshot = { xmin: n, xmax: n, xip: new Set(), text: `${n}:${n}:` };
    n++;
    if (calls === 2) return Promise.reject(new Error("Postgres is down"));
    return Promise.resolve({ snapshot, tenants: new Set(calls === 3 ? ["k"] : []) });
  };
  let t = 0;
  let version = "before";
  const reads: string[] = [];
  let hold: PromiseWithResolvers<void> | undefined;
  const cache = createTenantCache<string>({
    ttlMs: 10_000,
    now: () => t,
    changes: feed,
    read: async (keys) => {
      const value = version;
      reads.push(...keys);
      if (hold) await hold.promise;
      return new Map(keys.map((k) => [k, value]));
    },
  });
  await cache.settled();
  assert.equal(await cache.get("k"), "before");
  t += 5_000;
  cache.peek("k"); // a look that fails: k is not confirmed, and ages
  await cache.settled();
  t += 5_000;
  // k is ttlMs old: a request reads it (held), and starts the look that reports k's tenant changed.
  hold = Promise.withResolvers();
  const old = cache.get("k");
  await new Promise((r) => setTimeout(r, 0));
  version = "after";
  const fresh = cache.get("k");
  hold.resolve();
  hold = undefined;
  assert.equal(await old, "before", "the request that sent the older read still gets its answer");
  assert.equal(await fresh, "after", "the later one sent a read of its own");
  assert.deepEqual(reads, ["k", "k", "k"]);
  await cache.settled();
});

Deno.test("tenant cache with the change log: while every look fails, the entries are read again in bulk and stay fresh", async () => {
  // The log's table missing (an API started before `deno task migrate`), or Postgres refusing the look.
  const feed: TenantChangeFeed = () => Promise.reject(new Error('relation "tenant_changes" does not exist'));
  let t = 0;
  const reads: string[][] = [];
  const cache = createTenantCache<string>({
    ttlMs: 10_000,
    now: () => t,
    changes: feed,
    read: (keys) => {
      reads.push(keys);
      return Promise.resolve(new Map(keys.map((k) => [k, `v-${k}`])));
    },
  });
  await cache.settled();
  await Promise.all(["a", "b"].map((k) => cache.get(k)));
  for (let pass = 1; pass <= 4; pass++) {
    t += 5_000;
    cache.peek("a");
    await cache.settled();
    assert.equal(cache.peek("b")?.value, "v-b", `b answered without a read of its own at ${t} ms`);
  }
  // The first reads (one in flight at a time: a, then b), then one bulk read of both per pass.
  assert.deepEqual(reads, [["a"], ["b"], ["a", "b"], ["a", "b"], ["a", "b"], ["a", "b"]]);
});
