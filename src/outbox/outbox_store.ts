/**
 * The outbox store: the one module that reads and writes the `outbox`
 * table. One SQL operation per function; each takes the pool or, inside a
 * transaction that spans stores (the summary commit), that transaction.
 */
import { deleteBatch, type ExpiryBatch, type Fragment, olderThan, type Queryable } from "../db/queryable.ts";

/** An outbox row claimed by a relay. */
export interface OutboxRow {
  id: string;
  topic: string;
  dedupe_key: string;
  payload: Record<string, unknown>;
  attempts: number;
  claim_token: string;
}

/** A claimed row and where it goes, as stored with it (migration 009; see `MAIL_DESTINATION` in relay.ts). */
export interface ClaimedRow extends OutboxRow {
  /** The host (and port) of the payload's `webhook` URL, lower-cased; for every other row, the mail provider. */
  destination: string;
  /**
   * The tenant that chose the destination: a webhook row's tenant; '' for the mail provider, which no tenant
   * chooses. A tenant's webhooks share one cap of the slots, however many host names they use.
   */
  owner: string;
}

/** A row to add: its topic, its dedupe key (unique: a second row with it is not added) and its payload as JSON. */
export interface NewOutboxRow {
  topic: string;
  dedupeKey: string;
  payload: string;
}

/**
 * How many rows one claim may take from a destination or a tenant's webhooks: `budget` while another one
 * (destination, or tenant) has due rows in the claim, `alone` while none has. 0 and 0 excludes it.
 */
export interface Budget {
  budget: number;
  alone: number;
}

/** Budgets of the listed destinations (or tenants), and what every other one may take (either way). */
export interface Budgets {
  listed: Map<string, Budget>;
  others: number;
}

/** How many rows one claim may take: in all, per destination, and per tenant's webhooks. */
export interface ClaimLimits {
  limit: number;
  destinations: Budgets;
  owners: Budgets;
}

/**
 * Adds rows, in one statement; a row whose dedupe key is taken is not
 * added. Run it in the transaction that commits what the rows announce.
 */
export async function insertOutboxRows(sql: Queryable, rows: NewOutboxRow[]): Promise<void> {
  if (rows.length === 0) return;
  await sql`
    INSERT INTO outbox (topic, dedupe_key, payload)
    SELECT topic, dedupe_key, payload::jsonb FROM unnest(
      ${rows.map((r) => r.topic)}::text[], ${rows.map((r) => r.dedupeKey)}::text[], ${
    rows.map((r) => r.payload)
  }::text[]
    ) AS t(topic, dedupe_key, payload)
    ON CONFLICT (dedupe_key) DO NOTHING`;
}

/**
 * The part of another store's statement that adds the rows of the jobs it decided: each row names its job, and
 * only rows whose job is in `decided` (a relation of that statement with a `job_id uuid` column) are added; a
 * row whose dedupe key is taken is not. One statement with what the rows announce, so both commit or neither.
 */
export function insertOutboxRowsOf(
  sql: Queryable,
  rows: (NewOutboxRow & { jobId: string })[],
  decided: Fragment,
): Fragment {
  return sql`
    INSERT INTO outbox (topic, dedupe_key, payload)
    SELECT t.topic, t.dedupe_key, t.payload::jsonb FROM unnest(
      ${rows.map((r) => r.jobId)}::uuid[], ${rows.map((r) => r.topic)}::text[],
      ${rows.map((r) => r.dedupeKey)}::text[], ${rows.map((r) => r.payload)}::text[]
    ) AS t(job_id, topic, dedupe_key, payload)
    WHERE t.job_id IN (SELECT job_id FROM ${decided})
    ON CONFLICT (dedupe_key) DO NOTHING`;
}

/** Whether a row with any of these dedupe keys exists, sent or not. */
export async function hasRowWithKey(sql: Queryable, dedupeKeys: string[]): Promise<boolean> {
  const [row] = await sql<{ found: boolean }[]>`
    SELECT EXISTS (SELECT 1 FROM outbox WHERE dedupe_key = ANY(${dedupeKeys}::text[])) AS found`;
  return row!.found;
}

/**
 * Claims due rows within `limits` under a lease of `leaseMs`, in one statement. A row's lane is its (owner,
 * destination). The claim walks the lanes that have unsent rows (one probe of outbox_lanes each; a tenant
 * whose webhooks are at their cap is passed over in one probe), reads each lane's first due rows up to what
 * its destination and owner could take (so no backlog, however deep, hides another lane's rows), keeps each
 * destination's and each tenant's budget of them in (next_attempt_at, id) order, and leases those it can lock
 * (SKIP LOCKED: another relay's claim in the same instant keeps what it locked).
 * @returns the rows, and whether more may be due that these limits allow (the claim was full, another relay
 * took rows it picked, or a tenant's budget cut rows that had taken a destination's budget).
 */
export async function claimRows(
  sql: Queryable,
  { limit, destinations, owners }: ClaimLimits,
  leaseMs: number,
): Promise<{ rows: ClaimedRow[]; more: boolean }> {
  const token = crypto.randomUUID();
  const dNames = [...destinations.listed.keys()];
  const dBudgets = [...destinations.listed.values()];
  const oNames = [...owners.listed.keys()];
  const oBudgets = [...owners.listed.values()];
  const ownerFull = sql`(n.owner <> '' AND coalesce(
    (SELECT alone FROM owner_budget b WHERE b.owner = n.owner), ${owners.others}::int) = 0)`;
  const result = await sql<(ClaimedRow & { picked: number; cut: number })[]>`
    WITH RECURSIVE destination_budget AS (
      SELECT * FROM unnest(${dNames}::text[], ${dBudgets.map((b) => b.budget)}::int[],
        ${dBudgets.map((b) => b.alone)}::int[]) AS b(destination, budget, alone)
    ), owner_budget AS (
      SELECT * FROM unnest(${oNames}::text[], ${oBudgets.map((b) => b.budget)}::int[],
        ${oBudgets.map((b) => b.alone)}::int[]) AS b(owner, budget, alone)
    ), lanes AS (
      -- A loose index scan: the next lane after l, or, when l's owner is at its cap, the next owner's first.
      -- Exactly one branch of the inner UNION ALL runs (the other's condition on l is false).
      SELECT n.owner, n.destination, ${ownerFull} AS owner_full FROM (
        SELECT destination_owner AS owner, destination FROM outbox WHERE sent_at IS NULL AND failed_at IS NULL
        ORDER BY destination_owner, destination LIMIT 1
      ) n
      UNION ALL
      SELECT n.owner, n.destination, ${ownerFull} FROM lanes l CROSS JOIN LATERAL (
        (SELECT destination_owner AS owner, destination FROM outbox
          WHERE sent_at IS NULL AND failed_at IS NULL AND NOT l.owner_full
            AND (destination_owner, destination) > (l.owner, l.destination)
          ORDER BY destination_owner, destination LIMIT 1)
        UNION ALL
        (SELECT destination_owner, destination FROM outbox
          WHERE sent_at IS NULL AND failed_at IS NULL AND l.owner_full AND destination_owner > l.owner
          ORDER BY destination_owner, destination LIMIT 1)
      ) n
    ), due AS (
      -- Each lane's first due rows, at most what its destination and its owner could take in this claim.
      SELECT r.id, r.next_attempt_at, r.tenant, l.owner, l.destination
      FROM lanes l
      LEFT JOIN destination_budget db ON db.destination = l.destination
      LEFT JOIN owner_budget ob ON ob.owner = l.owner
      CROSS JOIN LATERAL (
        SELECT o.id, o.next_attempt_at, o.payload->>'tenant' AS tenant FROM outbox o
        WHERE o.destination_owner = l.owner AND o.destination = l.destination
          AND o.sent_at IS NULL AND o.failed_at IS NULL AND o.next_attempt_at <= now()
          AND (o.locked_until IS NULL OR o.locked_until < now())
        ORDER BY o.next_attempt_at, o.id
        LIMIT least(${limit}::int, coalesce(db.alone, ${destinations.others}::int),
          CASE WHEN l.owner = '' THEN ${limit}::int ELSE coalesce(ob.alone, ${owners.others}::int) END)
      ) r
      WHERE NOT l.owner_full
    ), seen AS (
      SELECT count(DISTINCT destination) AS destinations, count(DISTINCT tenant) AS tenants FROM due
    ), ranked AS (
      -- A destination (a tenant) uses its alone budget when the claim saw no other destination's (tenant's)
      -- due rows.
      SELECT due.*,
        row_number() OVER (PARTITION BY due.destination ORDER BY due.next_attempt_at, due.id) AS nth,
        CASE WHEN s.destinations = 1 THEN coalesce(db.alone, ${destinations.others}::int)
          ELSE coalesce(db.budget, ${destinations.others}::int) END AS room,
        CASE WHEN s.tenants = 1 THEN coalesce(ob.alone, ${owners.others}::int)
          ELSE coalesce(ob.budget, ${owners.others}::int) END AS owner_room
      FROM due CROSS JOIN seen s
      LEFT JOIN destination_budget db ON db.destination = due.destination
      LEFT JOIN owner_budget ob ON ob.owner = due.owner
    ), within_destination AS (
      SELECT *, row_number() OVER (PARTITION BY owner ORDER BY next_attempt_at, id) AS nth_of_owner
      FROM ranked WHERE nth <= room
    ), picked AS (
      SELECT id, destination, owner FROM within_destination WHERE owner = '' OR nth_of_owner <= owner_room
      ORDER BY next_attempt_at, id
      LIMIT ${limit}
    ), locked AS (
      -- The guard is checked again under the lock, on the row's newest version: a row another relay claimed,
      -- or made wait (a backoff, a deferral), since this statement read it is not ours. (coalesce(...) IS
      -- NULL is sent_at IS NULL AND failed_at IS NULL spelled so that the planner looks the picked ids up by
      -- primary key, not through a due index.)
      SELECT id FROM outbox
      WHERE id = ANY(ARRAY(SELECT id FROM picked)) AND coalesce(sent_at, failed_at) IS NULL
        AND next_attempt_at <= now() AND (locked_until IS NULL OR locked_until < now())
      FOR UPDATE SKIP LOCKED
    ), claimed AS (
      UPDATE outbox SET locked_until = now() + ${leaseMs} * interval '1 millisecond',
        claim_token = ${token}
      FROM picked WHERE outbox.id = ANY(ARRAY(SELECT id FROM locked)) AND picked.id = outbox.id
      RETURNING outbox.id::text, topic, dedupe_key, payload, attempts, claim_token::text, picked.destination,
        picked.owner
    )
    SELECT c.*, (SELECT count(*) FROM picked)::int AS picked,
      (SELECT count(*) FROM within_destination WHERE owner <> '' AND nth_of_owner > owner_room)::int AS cut
    FROM (VALUES (1)) AS one LEFT JOIN claimed c ON true`;
  const picked = result[0]?.picked ?? 0;
  const cut = result[0]?.cut ?? 0;
  const rows: ClaimedRow[] = [];
  for (const { picked: _, cut: __, ...row } of result) if (row.id !== null) rows.push(row);
  // Rows a tenant's budget cut may have kept others of their destination out: claim again (it progressed).
  return { rows, more: rows.length >= limit || rows.length < picked || (rows.length > 0 && cut > 0) };
}

/** Releases claimed rows without spending an attempt: each becomes due again after its wait (`waits` by id, ms). */
export async function releaseRows(sql: Queryable, rows: OutboxRow[], waits: Map<string, number>): Promise<void> {
  if (rows.length === 0) return;
  // The token guard: a row whose lease ran out and that another relay claimed since is not ours to move.
  await sql`
    UPDATE outbox SET locked_until = NULL, next_attempt_at = now() + w.ms * interval '1 millisecond'
    FROM unnest(${rows.map((r) => r.id)}::bigint[], ${rows.map((r) => r.claim_token)}::uuid[],
      ${rows.map((r) => Math.round(waits.get(r.id)!))}::float8[]) AS w(id, token, ms)
    WHERE outbox.id = w.id AND outbox.claim_token = w.token AND outbox.sent_at IS NULL`;
}

/**
 * Makes a destination's due rows wait `ms` (those due sooner), for every relay. Rows in flight (leased) are
 * not touched: each is recorded when its own send ends. @returns how many rows now wait.
 */
export async function postponeDestination(sql: Queryable, destination: string, ms: number): Promise<number> {
  const moved = await sql`
    UPDATE outbox SET next_attempt_at = now() + ${ms} * interval '1 millisecond'
    WHERE id IN (
      SELECT id FROM outbox
      WHERE sent_at IS NULL AND failed_at IS NULL AND next_attempt_at < now() + ${ms} * interval '1 millisecond'
        AND (locked_until IS NULL OR locked_until < now()) AND destination = ${destination}
      FOR UPDATE SKIP LOCKED
    )`;
  return moved.count;
}

/** Marks a claimed row failed for good (a person must retry it), if the claim is still ours and it is unsent. */
export async function markFailed(
  sql: Queryable,
  row: OutboxRow,
  { attempts, error }: { attempts: number; error: string },
): Promise<void> {
  await sql`
    UPDATE outbox SET attempts = ${attempts}, last_error = ${error}, failed_at = now(), locked_until = NULL
    WHERE id = ${row.id} AND claim_token = ${row.claim_token} AND sent_at IS NULL`;
}

/** Makes a claimed row due again after `waitMs`, counting its failed attempt, if the claim is still ours. */
export async function scheduleRetry(
  sql: Queryable,
  row: OutboxRow,
  { attempts, error, waitMs }: { attempts: number; error: string; waitMs: number },
): Promise<void> {
  await sql`
    UPDATE outbox SET attempts = ${attempts}, last_error = ${error}, locked_until = NULL,
      next_attempt_at = now() + ${waitMs} * interval '1 millisecond'
    WHERE id = ${row.id} AND claim_token = ${row.claim_token} AND sent_at IS NULL`;
}

/**
 * Marks rows sent, in one statement, with the provider's message id ('' for none). Needs no claim token:
 * once the provider accepted a row, it is sent, whoever holds the lease.
 */
export async function markSent(sql: Queryable, items: { id: string; providerId: string }[]): Promise<void> {
  await sql`
    UPDATE outbox SET sent_at = now(), locked_until = NULL, last_error = NULL,
      provider_message_id = NULLIF(p.provider_id, '')
    FROM unnest(${items.map((i) => i.id)}::bigint[], ${items.map((i) => i.providerId)}::text[])
      AS p(id, provider_id)
    WHERE outbox.id = p.id AND outbox.sent_at IS NULL`;
}

/**
 * Per tenant of `tenants`, the rows of `topic` sent in the last hour plus those another claim (not
 * `claimToken`) holds right now. Tenants with none are absent.
 */
export async function sentLastHour(
  sql: Queryable,
  { tenants, topics, claimToken }: { tenants: string[]; topics: string[]; claimToken: string },
): Promise<{ tenant: string; n: number }[]> {
  return await sql<{ tenant: string; n: number }[]>`
    SELECT payload->>'tenant' AS tenant, count(*)::int AS n FROM outbox
    WHERE payload->>'tenant' = ANY(${tenants}) AND topic = ANY(${topics})
      AND (sent_at > now() - interval '1 hour'
        OR (sent_at IS NULL AND locked_until > now() AND claim_token IS DISTINCT FROM ${claimToken}::uuid))
    GROUP BY 1`;
}

/** A job's outbox rows as the console shows them. */
export interface JobOutboxRow {
  topic: string;
  traceparent: string | null;
  sent: boolean;
  failed: boolean;
}

/** The outbox rows whose payload names `jobId`. */
export async function rowsOfJob(sql: Queryable, jobId: string): Promise<JobOutboxRow[]> {
  return await sql<JobOutboxRow[]>`
    SELECT topic, payload->>'traceparent' AS traceparent, sent_at IS NOT NULL AS sent, failed_at IS NOT NULL AS failed
    FROM outbox WHERE payload->>'job_id' = ${jobId}`;
}

/** An outbox row as `outbox list` shows it. */
export interface OutboxListRow {
  id: string;
  dedupe_key: string;
  topic: string;
  attempts: number;
  state: "pending" | "sent" | "failed";
  next_attempt_at: Date;
  last_error: string | null;
  created_at: Date;
  /** Whose notification it is, and where it goes (an email address or a webhook URL), from its payload. */
  tenant: string | null;
  destination: string | null;
}

/** Lists unsent rows (or only failed ones), oldest first. */
export async function listOutbox(sql: Queryable, { failed = false, limit = 1000 } = {}): Promise<OutboxListRow[]> {
  return await sql<OutboxListRow[]>`
    SELECT id::text, dedupe_key, topic, attempts, next_attempt_at, last_error, created_at,
      payload->>'tenant' AS tenant, coalesce(payload->>'to', payload->>'webhook') AS destination,
      CASE WHEN sent_at IS NOT NULL THEN 'sent' WHEN failed_at IS NOT NULL THEN 'failed' ELSE 'pending' END AS state
    FROM outbox
    WHERE sent_at IS NULL AND (${!failed} OR failed_at IS NOT NULL)
    ORDER BY id LIMIT ${limit}`;
}

/**
 * Makes failed rows due again with a fresh attempt count. Only failed rows
 * are touched, so retrying a row that was meanwhile sent does nothing.
 * @returns how many rows were reset.
 */
export async function retryFailed(sql: Queryable, ids: string[] | "all"): Promise<number> {
  const rows = ids === "all"
    ? await sql`
      UPDATE outbox SET failed_at = NULL, attempts = 0, next_attempt_at = now(), locked_until = NULL
      WHERE failed_at IS NOT NULL AND sent_at IS NULL RETURNING id`
    : await sql`
      UPDATE outbox SET failed_at = NULL, attempts = 0, next_attempt_at = now(), locked_until = NULL
      WHERE id = ANY(${ids}::bigint[]) AND failed_at IS NOT NULL AND sent_at IS NULL RETURNING id`;
  return rows.length;
}

/** Backlog figures for metrics and runbooks. */
export async function outboxBacklog(
  sql: Queryable,
): Promise<{ unsent: number; failed: number; oldest_unsent_s: number }> {
  const [row] = await sql<{ unsent: number; failed: number; oldest_unsent_s: number }[]>`
    SELECT count(*) FILTER (WHERE failed_at IS NULL)::int AS unsent,
      count(*) FILTER (WHERE failed_at IS NOT NULL)::int AS failed,
      coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE failed_at IS NULL)), 0)::float8 AS oldest_unsent_s
    FROM outbox WHERE sent_at IS NULL`;
  return row!;
}

/**
 * A condition for another store's statement: whether an unsent row (pending
 * or failed: a failed row may still be retried) names the job `jobId`.
 */
export function hasUnsentRowOf(sql: Queryable, jobId: Fragment): Fragment {
  return sql`EXISTS (SELECT 1 FROM outbox o WHERE o.payload->>'job_id' = ${jobId}::text AND o.sent_at IS NULL)`;
}

/** Deletes up to `limit` rows sent more than `olderThanMs` ago. @returns rows deleted. */
export function deleteSentRows(sql: Queryable, { olderThanMs, limit }: ExpiryBatch): Promise<number> {
  return deleteBatch(sql, { table: "outbox", key: "id", where: olderThan(sql, "sent_at", olderThanMs), limit });
}

/** Deletes the rows with these dedupe keys that are not sent yet (nor being sent). @returns rows deleted. */
export async function deleteUnsentRows(sql: Queryable, dedupeKeys: string[]): Promise<number> {
  const deleted = await sql`
    DELETE FROM outbox WHERE dedupe_key = ANY(${dedupeKeys}) AND sent_at IS NULL
      AND (locked_until IS NULL OR locked_until < now())
    RETURNING id`;
  return deleted.length;
}
