/**
 * The two baselines of the ingest rows, shared by `ingest_server.ts` and
 * `ingest_variants.ts`: a bare `Deno.serve` handler that parses the JSON and
 * answers the same 202, and the design's floor, the same handler plus the
 * one Redis script an accepted POST must run (the scope's idempotency record
 * and the stream entry), through the service's own ioredis client.
 */
import type { RedisClient } from "../../src/clients.ts";
import { defineScript } from "../../src/redis/script.ts";

// FLOOR: the intake script's shape reduced to what every accepted POST needs.
// KEYS[1]  the scope's idempotency record.
// KEYS[2]  the lane's stream.
// ARGV[1]  the job id; ARGV[2] the tenant; ARGV[3] the payload (the body as sent); ARGV[4] the answer to store;
// ARGV[5]  the record's lifetime in seconds.
// Returns the stored answer when the scope has one, else false after the XADD and the SET.
const FLOOR = defineScript(`
local stored = redis.call('GET', KEYS[1])
if stored then return stored end
redis.call('XADD', KEYS[2], '*', 'job_id', ARGV[1], 'tenant', ARGV[2], 'payload', ARGV[3])
redis.call('SET', KEYS[1], ARGV[4], 'EX', ARGV[5])
return false`);

const accepted = (body: string, id: string) =>
  new Response(body, {
    status: 202,
    headers: { "content-type": "application/json", location: `/v1/summaries/${id}` },
  });

/** A bare handler: `req.json()` and the 202 an accepted POST gets. */
export function bareHandler(): (req: Request) => Promise<Response> {
  const id = crypto.randomUUID();
  const body = JSON.stringify({ job_id: id, status: "queued" });
  return async (req) => {
    await req.json();
    return accepted(body, id);
  };
}

/**
 * The floor: the body read and parsed (as `req.json()` does), one script through ioredis (the record of the
 * request's Idempotency-Key and the stream entry), and the 202. No authentication, validation or hashing: a
 * random job id.
 */
export function floorHandler(redis: RedisClient, prefix: string): (req: Request) => Promise<Response> {
  const stream = `${prefix}:{t:bench}:floor`;
  return async (req) => {
    const text = await req.text();
    JSON.parse(text);
    const id = crypto.randomUUID();
    const answer = JSON.stringify({ job_id: id, status: "queued" });
    const key = `${prefix}:{t:bench}:floor-idem:${req.headers.get("idempotency-key")}`;
    const stored = await FLOOR.run(redis, [key, stream], [id, "bench", text, answer, 600]) as string | null;
    return accepted(stored ?? answer, id);
  };
}
