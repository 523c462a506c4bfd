import assert from "node:assert/strict";
import { dlqCommand } from "../../src/cli/dlq_command.ts";
import { outboxCommand } from "../../src/cli/outbox_command.ts";
import { providerCommand } from "../../src/cli/provider_command.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createProviderFlow, providerStateKey } from "../../src/provider/flow_control.ts";
import { tenantCommand } from "../../src/cli/tenant_command.ts";
import { DEAD_LETTER_BOUNDS, deadLetter, droppedDeadLetters, pagesOfDeadLetters } from "../../src/queue/dead_letter.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import { commitResults } from "../../src/runs/commit.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { type LaneKeys, type ServiceKeys, serviceKeys } from "../../src/runs/keys.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { markFailedHook } from "../../src/runs/job_status.ts";
import { parseApiKey } from "../../src/tenants/tenant_store.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

function capture() {
  const lines: string[] = [];
  return { lines, out: (line: string) => lines.push(line) };
}

Deno.test("operator commands", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  // The dead letters are tenant acme's, in its lane.
  const service = serviceKeys(r.prefix);
  const keys = service.lane("acme");
  /** Tenant acme's lane under `prefix`, known to the registry as `dlq` finds lanes. */
  const acmeUnder = async (prefix: string): Promise<[ServiceKeys, LaneKeys]> => {
    const under = serviceKeys(prefix);
    await announceLane(r.redis, under.registry, "acme");
    return [under, under.lane("acme")];
  };
  try {
    await t.step("tenant create prints the key as the last line; list shows it; revoke revokes it", async () => {
      const c = capture();
      assert.equal(await tenantCommand(db.sql, ["create", "acme"], c.out), 0);
      assert.ok(parseApiKey(c.lines.at(-1)!), "last line is the key");
      const list = capture();
      await tenantCommand(db.sql, ["list", "--json"], list.out);
      assert.deepEqual(JSON.parse(list.lines[0]!).active_keys, 1);
      assert.equal(await tenantCommand(db.sql, ["revoke", "acme"], capture().out), 0);
      const after = capture();
      await tenantCommand(db.sql, ["list", "--json"], after.out);
      assert.equal(JSON.parse(after.lines[0]!).active_keys, 0);
      assert.equal(await tenantCommand(db.sql, ["create", "bad name"], capture().out), 2);
    });

    await t.step(
      "tenant set NAME --weight N: list shows the weight; bad input exits 2, an unknown tenant 1",
      async () => {
        await tenantCommand(db.sql, ["create", "weighty"], capture().out);
        const set = capture();
        assert.equal(await tenantCommand(db.sql, ["set", "weighty", "--weight", "3"], set.out), 0);
        assert.match(set.lines[0]!, /weight 3/);
        assert.equal(await tenantCommand(db.sql, ["set", "weighty", "--weight=1000"], capture().out), 0);
        const json = capture();
        await tenantCommand(db.sql, ["list", "--json"], json.out);
        const rows = json.lines.map((l) => JSON.parse(l));
        assert.equal(rows.find((r) => r.name === "weighty").weight, 1000);
        assert.equal(rows.find((r) => r.name === "acme").weight, 1, "the default");
        const table = capture();
        await tenantCommand(db.sql, ["list"], table.out);
        assert.match(table.lines[0]!, /^name +weight +active_keys/);
        assert.match(table.lines.find((l) => l.startsWith("weighty"))!, /^weighty +1000 /);
        // Refused without touching the weight: exit 2 with the usage.
        const errors: string[] = [];
        const error = console.error;
        console.error = (line: string) => errors.push(line);
        try {
          for (const bad of [["0"], ["1001"], ["2.5"], ["-1"], ["x"], ["1e3"], []]) {
            assert.equal(
              await tenantCommand(db.sql, ["set", "weighty", "--weight", ...bad], capture().out),
              2,
              `${bad}`,
            );
          }
          assert.equal(await tenantCommand(db.sql, ["set", "weighty", "--height", "3"], capture().out), 2);
          assert.equal(await tenantCommand(db.sql, ["set", "weighty"], capture().out), 2);
          assert.ok(errors.some((l) => l.startsWith("Usage:") && l.includes("set NAME --weight N")));
          assert.ok(errors.some((l) => l.includes("from 1 to 1000") && l.includes('"1001"')));
          errors.length = 0;
          assert.equal(await tenantCommand(db.sql, ["set", "nobody", "--weight", "2"], capture().out), 1);
          assert.deepEqual(errors, ['No tenant named "nobody"']);
        } finally {
          console.error = error;
        }
        const after = capture();
        await tenantCommand(db.sql, ["list", "--json"], after.out);
        assert.equal(after.lines.map((l) => JSON.parse(l)).find((r) => r.name === "weighty").weight, 1000);
      },
    );

    await t.step(
      "dlq list prints JSON lines with id, job_id, tenant, reason, deliveries; replay twice is harmless",
      async () => {
        const jobId = crypto.randomUUID();
        await enqueueToLane(r.redis, service, { jobId, tenant: "acme", request: { text: "t", notify: "a@b.co" } });
        await ensureGroup(r.redis, keys);
        const reply = await r.redis.xreadgroup("GROUP", keys.group, "c", "STREAMS", keys.stream, ">") as [
          string,
          [string, string[]][],
        ][];
        const [id, flat] = reply[0]![1][0]!;
        const fields = Object.fromEntries(
          Array.from({ length: flat.length / 2 }, (_, i) => [flat[2 * i], flat[2 * i + 1]]),
        );
        await deadLetter(r.redis, keys, { id, fields, deliveries: 6 }, "exceeded 5 deliveries", markFailedHook);
        assert.equal(await r.redis.hget(keys.job(jobId), "status"), "failed");
        const list = capture();
        await dlqCommand({ redis: r.redis, sql: db.sql }, service, ["list"], { out: list.out });
        const row = JSON.parse(list.lines[0]!);
        assert.deepEqual(Object.keys(row).slice(0, 5), ["id", "job_id", "tenant", "reason", "deliveries"]);
        assert.deepEqual([row.job_id, row.tenant, row.reason, row.deliveries], [
          jobId,
          "acme",
          "exceeded 5 deliveries",
          6,
        ]);
        const before = await r.redis.xlen(keys.stream);
        assert.equal(
          await dlqCommand({ redis: r.redis, sql: db.sql }, service, ["replay", row.id], { out: capture().out }),
          0,
        );
        assert.equal(
          await dlqCommand({ redis: r.redis, sql: db.sql }, service, ["replay", row.id], { out: capture().out }),
          0,
        );
        assert.equal(await r.redis.xlen(keys.stream), before + 1, "enqueued once");
        assert.equal(await r.redis.hget(keys.job(jobId), "status"), "queued");
        const [entry] = await r.redis.xrevrange(keys.stream, "+", "-", "COUNT", 1);
        assert.equal(entry![1][1], jobId, "the original job id");
      },
    );

    await t.step("outbox list --failed and retry put failed rows back in the queue", async () => {
      const ids = [crypto.randomUUID(), crypto.randomUUID()];
      await commitResults(db.sql, ids.map((jobId) => ({ jobId, tenant: "acme", summary: "s", notify: "a@b.co" })));
      await db.sql`UPDATE outbox SET failed_at = now(), attempts = 10, last_error = 'http_422: no'`;
      const list = capture();
      await outboxCommand(db.sql, ["list", "--failed", "--json"], list.out);
      assert.equal(list.lines.length, 2);
      const first = JSON.parse(list.lines[0]!);
      assert.equal(first.state, "failed");
      // Whose and where to, from the payload: what an operator needs before retrying.
      assert.deepEqual([first.tenant, first.destination], ["acme", "a@b.co"]);
      await outboxCommand(db.sql, ["retry", first.id], capture().out);
      const [one] = await db.sql`SELECT attempts, failed_at FROM outbox WHERE id = ${first.id}`;
      assert.deepEqual([one!.attempts, one!.failed_at], [0, null]);
      const all = capture();
      await outboxCommand(db.sql, ["retry", "--all-failed"], all.out);
      assert.match(all.lines[0]!, /^1 failed row/);
      assert.equal(await outboxCommand(db.sql, ["retry", "abc"], capture().out), 2);
    });

    await t.step(
      "the dead-letter stream is bounded: big payloads are truncated and refused on replay, old entries trimmed",
      async () => {
        const [bound, boundKeys] = await acmeUnder(`${r.prefix}:bound`);
        // The dead-letter step moves only a message still in its stream.
        const inStream = async () => await r.redis.xadd(boundKeys.stream, "*", "job_id", "x") as string;
        const big = "x".repeat(150_000);
        const small = crypto.randomUUID();
        await deadLetter(r.redis, boundKeys, {
          id: await inStream(),
          fields: { job_id: "big", tenant: "acme", payload: JSON.stringify({ text: big, notify: "a@b.co" }) },
          deliveries: 1,
        }, "poison");
        await deadLetter(r.redis, boundKeys, {
          id: await inStream(),
          fields: { job_id: small, tenant: "acme", payload: JSON.stringify({ text: "short", notify: "a@b.co" }) },
          deliveries: 6,
        }, "exceeded 5 deliveries");
        const [bigEntry] = await r.redis.xrange(boundKeys.dead, "-", "+", "COUNT", 1);
        const payload = bigEntry![1][bigEntry![1].indexOf("payload") + 1]!;
        assert.equal(payload.length, DEAD_LETTER_BOUNDS.keptFieldChars, "the payload kept is a bounded prefix");
        const list = capture();
        await dlqCommand({ redis: r.redis, sql: db.sql }, bound, ["list", "--json"], { out: list.out });
        assert.deepEqual(list.lines.map((l) => JSON.parse(l).replayable), [false, true]);
        const out = capture();
        assert.equal(
          await dlqCommand({ redis: r.redis, sql: db.sql }, bound, ["replay", "--all"], { out: out.out }),
          1,
        );
        assert.match(out.lines.at(-1)!, /1 dead letter\(s\) replayed\. 1 could not be/);
        const queued = await r.redis.xrange(boundKeys.stream, "-", "+");
        assert.deepEqual(queued.map(([, f]) => f[1]), [small], "only the whole entry ran again");
        assert.equal(await r.redis.xlen(boundKeys.dead), 1, "the truncated entry stays for the operator to read");

        const saved = DEAD_LETTER_BOUNDS.maxEntries;
        DEAD_LETTER_BOUNDS.maxEntries = 100;
        let dropped = 0;
        try {
          for (let i = 0; i < 600; i++) {
            dropped += await deadLetter(r.redis, boundKeys, {
              id: await inStream(),
              fields: { job_id: `j${i}`, tenant: "acme", payload: "{}" },
              deliveries: 6,
            }, "x");
          }
        } finally {
          DEAD_LETTER_BOUNDS.maxEntries = saved;
        }
        // MAXLEN ~ trims whole stream nodes (100 entries each by default), so the bound holds within one node.
        const length = await r.redis.xlen(boundKeys.dead);
        assert.ok(length <= 200, `dead-letter stream trimmed to about its bound, not ${length}`);
        const [newest] = await r.redis.xrevrange(boundKeys.dead, "+", "-", "COUNT", 1);
        assert.equal(newest![1][1], "j599", "the newest are the ones kept");
        // Every drop is counted, and `dlq list` says how many (apart from its JSON lines).
        assert.equal(dropped, 601 - length, "each dead-letter step reports what its trim dropped");
        assert.equal(await droppedDeadLetters(r.redis, boundKeys), dropped);
        const listed = capture();
        const notes = capture();
        await dlqCommand({ redis: r.redis, sql: db.sql }, bound, ["list", "--json"], {
          out: listed.out,
          err: notes.out,
        });
        assert.equal(listed.lines.length, length, "stdout holds only the JSON lines");
        assert.match(notes.lines.join("\n"), new RegExp(`^${dropped} older dead letter\\(s\\) .* were dropped`));
      },
    );

    await t.step("dlq list pages through a long dead-letter stream instead of loading it whole", async () => {
      const [pages, pageKeys] = await acmeUnder(`${r.prefix}:pages`);
      const p = r.redis.pipeline();
      for (let i = 0; i < 1_201; i++) {
        p.xadd(
          pageKeys.dead,
          "*",
          "job_id",
          `j${i}`,
          "tenant",
          "acme",
          "dead_reason",
          "test",
          "dead_deliveries",
          "6",
          "dead_at",
          "t",
          "original_id",
          "0-1",
        );
      }
      await p.exec();
      const sizes: number[] = [];
      for await (const page of pagesOfDeadLetters(r.redis, pageKeys)) sizes.push(page.length);
      assert.deepEqual(sizes, [500, 500, 201]);
      const list = capture();
      await dlqCommand({ redis: r.redis, sql: db.sql }, pages, ["list", "--json"], { out: list.out });
      assert.equal(list.lines.length, 1_201);
      assert.equal(new Set(list.lines.map((l) => JSON.parse(l).job_id)).size, 1_201, "each once, none skipped");
    });

    await t.step(
      "provider status shows each limit's source, the pause and the breaker, as text or JSON",
      async () => {
        const flow = createProviderFlow({ redis: r.redis, log: silentLogger }, {
          key: providerStateKey(r.prefix, { baseURL: "http://model", model: "m", apiKey: "sk" }),
          rpm: 6000,
          cooldownMs: 30_000,
          probeLeaseMs: 5_000,
        });
        const permit = await flow.acquire(100);
        await permit.settle({
          value: {
            text: "ok",
            headers: new Headers({ "x-ratelimit-limit-requests": "600", "x-ratelimit-remaining-requests": "599" }),
          },
        });
        const text = capture();
        assert.equal(await providerCommand(flow, "http://model m", ["status"], text.out), 0);
        assert.match(
          text.lines.join("\n"),
          /requests\/min +600 +\(source: headers; configured 6000, from headers 600\)/,
        );
        assert.match(text.lines.join("\n"), /breaker +closed/);
        // Where each figure came from, and how old it is.
        assert.match(text.lines.join("\n"), /configured by +rpm 6000 tpm - \(live until .* \(in \d+\.\d s\)\)/);
        assert.match(text.lines.join("\n"), /headers +limits last heard \d{4}-\d\d-\d\dT/);
        assert.match(text.lines.join("\n"), /evidence +0 jobs failing since the last success/);
        const json = capture();
        await providerCommand(flow, "http://model m", ["status", "--json"], json.out);
        const doc = JSON.parse(json.lines[0]!);
        assert.equal(doc.rpm.source, "headers");
        assert.equal(doc.remaining.requests, 599);
        assert.equal(doc.breaker.state, "closed");
        const local = capture();
        assert.equal(await providerCommand(undefined, "extractive", ["status"], local.out), 0);
        assert.match(local.lines[0]!, /no shared limiter/);
        assert.equal(await providerCommand(flow, "x", ["stats"], capture().out), 2);
      },
    );
  } finally {
    await r.close();
    await db.close();
  }
});
