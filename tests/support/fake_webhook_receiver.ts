/**
 * A webhook receiver the way a careful client would run one: it verifies
 * each delivery's Standard Webhooks signature with its tenant's secret
 * (the tenant is the last path segment), processes each `webhook-id` once
 * (a redelivery after a relay crash is acknowledged and ignored), and can be
 * told to fail some requests.
 */
import { verifyWebhook } from "../webhooks/_receiver.ts";

/** A running receiver. */
export interface FakeWebhookReceiver {
  /** Base URL: deliveries go to `${url}/<tenant>`. */
  url: string;
  /** Every request received, redeliveries and failures included. */
  readonly requests: number;
  /** webhook-ids processed (once each), with the job id of each. */
  readonly processed: Map<string, string>;
  /** The bodies processed (once each), in order. */
  readonly bodies: Record<string, unknown>[];
  /** Deliveries whose webhook-id was already processed. */
  readonly redelivered: number;
  /** Deliveries whose signature did not verify (answered 401). */
  readonly badSignatures: number;
  close(): Promise<void>;
}

/** Starts the receiver on an ephemeral loopback port; `fail(n)` answering true makes request n a 500. */
export function startFakeWebhookReceiver(
  secrets: Map<string, string>,
  fail: (n: number) => boolean = () => false,
): FakeWebhookReceiver {
  const state = {
    requests: 0,
    redelivered: 0,
    badSignatures: 0,
    processed: new Map<string, string>(),
    bodies: [] as Record<string, unknown>[],
  };
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
    const n = ++state.requests;
    const body = await req.text();
    if (fail(n)) return new Response("scripted failure", { status: 500 });
    const tenant = decodeURIComponent(new URL(req.url).pathname.split("/").at(-1) ?? "");
    const secret = secrets.get(tenant);
    const nowSeconds = Math.floor(Date.now() / 1000);
    if (!secret || !(await verifyWebhook({ headers: req.headers, body, secret, nowSeconds }))) {
      state.badSignatures++;
      return new Response("bad signature", { status: 401 });
    }
    const id = req.headers.get("webhook-id")!;
    if (state.processed.has(id)) state.redelivered++;
    else {
      // A summary's webhook names its job, a run's its run.
      const parsed = JSON.parse(body) as { job_id?: string; run_id?: string };
      state.processed.set(id, parsed.job_id ?? parsed.run_id ?? "");
      state.bodies.push(parsed);
    }
    return new Response(null, { status: 204 });
  });
  return {
    url: `http://127.0.0.1:${server.addr.port}/hooks`,
    get bodies() {
      return state.bodies;
    },
    get requests() {
      return state.requests;
    },
    get processed() {
      return state.processed;
    },
    get redelivered() {
      return state.redelivered;
    },
    get badSignatures() {
      return state.badSignatures;
    },
    close: () => server.shutdown(),
  };
}
