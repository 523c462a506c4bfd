/**
 * The console's POST actions: each checks the form's CSRF token, does its
 * work through the module that owns it (dead-letter replay, outbox retry,
 * signing out), logs it, and redirects back with a note saying what happened.
 */
import { retryFailed } from "../outbox/outbox_store.ts";
import { replayDeadLetters, replaySummary, type ReplayTarget } from "../runs/dead_letters.ts";
import { sameText } from "./admin_auth.ts";
import type { ConsoleDeps } from "./_deps.ts";
import { html } from "./html.ts";
import { back, page } from "./layout.ts";
import type { SignedInRequest } from "./session.ts";

/** Runs the action at `path` for `session`, whose forms carry `view.csrf`. */
export async function act({ deps, sessions, view, req, path, session }: SignedInRequest): Promise<Response> {
  const fields = await sessions.form(req);
  if (!sameText(fields.get("csrf") ?? "", view.csrf)) {
    return page(
      view,
      "Refused",
      html`<p>This form has expired or did not come from the console. Go back and try again.</p>`,
      { status: 403 },
    );
  }
  if (path === "/console/logout") return await sessions.logout(session);
  if (path === "/console/dead-letters/replay") return await replay(deps, fields);
  if (path === "/console/outbox/retry") return await retry(deps, fields);
  return page(view, "Not found", html`<p>No such action.</p>`, { status: 404 });
}

/** Replays one dead letter (`id`, in `tenant`'s lane), or every one (`all`). */
async function replay({ redis, sql, keys, log, ack }: ConsoleDeps, fields: URLSearchParams): Promise<Response> {
  const id = fields.get("id"), tenant = fields.get("tenant");
  const all = Boolean(fields.get("all"));
  const target: ReplayTarget = all ? { all: true } : { id: id ?? "", tenant: tenant || undefined };
  const report = await replayDeadLetters({ redis, sql, ack }, keys, target);
  log.info("console_dead_letters_replayed", { all, id, tenant });
  return back("/console/dead-letters", replaySummary(report, target));
}

/** Makes one failed outbox row (`id`), or every one (`all`), due again. */
async function retry({ sql, log }: ConsoleDeps, fields: URLSearchParams): Promise<Response> {
  const id = fields.get("id");
  const n = await retryFailed(sql, fields.get("all") ? "all" : /^\d+$/.test(id ?? "") ? [id!] : []);
  log.info("console_outbox_retried", { all: Boolean(fields.get("all")), id, rows: n });
  return back("/console/outbox", `${n} row(s) made due again.`);
}
