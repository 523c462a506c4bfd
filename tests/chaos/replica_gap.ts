/**
 * How much an asynchronous replica misses when its primary's process is
 * SIGKILLed under load: what `deno task chaos --sentinel --replicas-ack 0`
 * would lose, measured without the service around it.
 *
 * Each trial starts a primary (AOF, fsync always) and a replica on free
 * loopback ports in a temporary directory, lets 16 clients INCR a counter
 * each as fast as they can for 0.3 to 0.8 s, SIGKILLs the primary, promotes
 * the replica, and counts the increments the primary acknowledged that the
 * replica does not have.
 *
 *   deno run --allow-net=127.0.0.1 --allow-env --allow-run=redis-server --allow-read --allow-write tests/chaos/replica_gap.ts [--trials N]
 */
import { Redis } from "ioredis";
import { sleep } from "../../src/async/timeout.ts";
import { freePort } from "../support/free_port.ts";

const WRITERS = 16;
const at = Deno.args.indexOf("--trials");
const TRIALS = at >= 0 ? Number(Deno.args[at + 1]) : 15;
if (!Number.isInteger(TRIALS) || TRIALS < 1) {
  console.error(`--trials must be a positive integer (got ${JSON.stringify(Deno.args[at + 1])})`);
  Deno.exit(2);
}

function redisServer(dir: string, port: number, replicaOf?: number): Deno.ChildProcess {
  const args = ["--port", String(port), "--bind", "127.0.0.1", "--dir", dir, "--save", ""];
  args.push("--appendonly", "yes", "--appendfsync", "always", "--appenddirname", `aof-${port}`);
  // The first sync starts at once instead of waiting 5 s for more replicas.
  args.push("--repl-diskless-sync-delay", "0");
  if (replicaOf !== undefined) args.push("--replicaof", "127.0.0.1", String(replicaOf));
  return new Deno.Command("redis-server", { args, stdout: "null", stderr: "null" }).spawn();
}

let acknowledged = 0, missing = 0, trialsMissing = 0;
for (let trial = 1; trial <= TRIALS; trial++) {
  const dir = await Deno.makeTempDir({ prefix: "oncely-replica-gap-" });
  const [primaryPort, replicaPort] = [freePort(), freePort()];
  const primary = redisServer(dir, primaryPort);
  const replica = redisServer(dir, replicaPort, primaryPort);
  const onReplica = new Redis({ port: replicaPort, host: "127.0.0.1" });
  const onPrimary = new Redis({ port: primaryPort, host: "127.0.0.1" });
  for (const client of [onReplica, onPrimary]) client.on("error", () => {});
  try {
    // Streaming, not just synced: after a full sync the primary holds the stream back until the replica's first
    // acknowledgement (up to a second later, though INFO already says online), and a kill then loses everything
    // written since the sync. A write seen on the replica shows the stream flows.
    for (let i = 0; (await onReplica.get("streaming").catch(() => null)) === null; i++) {
      if (i > 200) throw new Error(`trial ${trial}: the replica did not receive a write within 10 s`);
      await onPrimary.set("streaming", "1").catch(() => {});
      await sleep(50);
    }
    onPrimary.disconnect();
    // The last value each client saw acknowledged: the replica must hold at least that much.
    const seen = new Array<number>(WRITERS).fill(0);
    let stop = false;
    const writers = seen.map(async (_, i) => {
      const client = new Redis({
        port: primaryPort,
        host: "127.0.0.1",
        maxRetriesPerRequest: 0,
        retryStrategy: () => null,
      });
      client.on("error", () => {});
      try {
        while (!stop) seen[i] = await client.incr(`counter:${i}`);
      } catch { /* the primary is gone */ }
      client.disconnect();
    });
    await sleep(300 + Math.random() * 500);
    primary.kill("SIGKILL");
    stop = true;
    await Promise.all([primary.status, ...writers]);
    await sleep(300); // what was in flight on the replication link arrives, or never will
    await onReplica.replicaof("NO", "ONE");
    const held = await Promise.all(seen.map((_, i) => onReplica.get(`counter:${i}`)));
    const gap = seen.reduce((sum, value, i) => sum + Math.max(0, value - Number(held[i] ?? 0)), 0);
    const total = seen.reduce((sum, value) => sum + value, 0);
    acknowledged += total;
    missing += gap;
    if (gap > 0) trialsMissing++;
    console.log(`trial ${trial}: ${total} writes acknowledged, ${gap} missing on the replica`);
  } finally {
    onReplica.disconnect();
    onPrimary.disconnect();
    replica.kill("SIGKILL");
    try {
      primary.kill("SIGKILL");
    } catch { /* already killed */ }
    await Promise.all([replica.status, primary.status]);
    await Deno.remove(dir, { recursive: true });
  }
}
console.log(
  `${TRIALS} SIGKILLs of the primary, ${acknowledged} writes acknowledged by it: ${missing} missing on the promoted ` +
    `replica (in ${trialsMissing} trial(s))`,
);
