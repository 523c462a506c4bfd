/**
 * Several deployments (`LLM_DEPLOYMENTS`) as {@linkcode Models}: each serves some models, each model of each
 * deployment under its own shared limiter and breaker (a provider limits a key per model). A call goes to a
 * deployment of its first model by weight, to another of that model when the one it would pick has no permit
 * now (paced, paused, broken), and to its next model only when every deployment of the current one is
 * unavailable: breaker open (an outage, quota out, a key refused) or paused longer than `fallbackAfterMs`. A short
 * 429 pause is waited for. The worker's read gate adds up the capacity of the models its calls asked for lately.
 */
import { sleep } from "../async/timeout.ts";
import type { LLM } from "../llm/llm.ts";
import type { Acquired, AcquireOptions, Capacity, Models } from "../llm/models.ts";
import { GateRefused } from "../retry/errors.ts";
import type { ProviderFlow, Refusal } from "./flow_control.ts";
import { tokenGate } from "./deployment.ts";

/** One deployment, as the router sees it. */
export interface RoutedDeployment {
  /** As `model_attempts.deployment` records it. */
  name: string;
  llm: LLM;
  weight: number;
  /** The flow control of each model it serves. */
  flows: ReadonlyMap<string, ProviderFlow>;
}

/** Options for {@linkcode createRouter}. */
export interface RouterOptions {
  deployments: readonly RoutedDeployment[];
  /** The model a call that accepts any is asked of. */
  defaultModel: string;
  /** LLM_FALLBACK_AFTER_S, in ms: a pause longer than this makes a deployment unavailable. */
  fallbackAfterMs: number;
  /** Told when a call goes to a model after the first it accepts. */
  fellBack?(from: string, to: string): void;
  random?: () => number;
}

/** Reasons a deployment cannot take a call for a while: its breaker is open, or its probe is out. */
const BROKEN = new Set(["breaker_open", "half_open"]);

/** How long the read gate counts a model after a call last asked for it. */
const RECENT_MS = 10_000;

/** The deployments serving one model, with the smooth weighted round-robin state of its picks. */
interface ModelRoute {
  model: string;
  deployments: RoutedDeployment[];
  current: number[];
  total: number;
}

/** The router over `deployments`: see the module's comment. */
export function createRouter(options: RouterOptions): Models {
  const { deployments, defaultModel, fallbackAfterMs, fellBack } = options;
  const random = options.random ?? Math.random;
  const routes = new Map<string, ModelRoute>();
  for (const d of deployments) {
    for (const model of d.flows.keys()) {
      const route = routes.get(model) ?? { model, deployments: [], current: [], total: 0 };
      route.deployments.push(d);
      route.current.push(0);
      route.total += d.weight;
      routes.set(model, route);
    }
  }
  // A call that names no model (a summary) must still go out as the model it was routed for: the deployment's
  // client alone would ask for its own first model, which may be another one than the permit, price and record say.
  const clients = new Map<RoutedDeployment, Map<string, LLM>>();
  for (const d of deployments) {
    clients.set(
      d,
      new Map([...d.flows.keys()].map((model) => [model, {
        complete: (prompt, callOptions) => d.llm.complete(prompt, { ...callOptions, model }),
      }])),
    );
  }
  const gates = new Map<ProviderFlow, (averageTokens: number) => Promise<Capacity>>();
  for (const d of deployments) for (const flow of d.flows.values()) gates.set(flow, tokenGate(flow));
  /** When a call last asked for each model (performance.now()). */
  const asked = new Map<string, number>();
  // Callers in `acquire` without a permit or a booked slot: the permits the gate sees are theirs first. Counted from
  // the moment they ask (a job asks in the tick it starts, so the worker's next look counts it), until a flow books
  // them a slot (they then sleep in `tryAcquire` until it comes, and that flow's gate has already left the slot out:
  // counting them here too read fewer jobs than the flows allowed while calls were paced) or grants a permit; again
  // from a refusal on.
  let waiting = 0;

  const tryModel = async (
    route: ModelRoute,
    estimate: number,
    { signal, jobId, tenant }: AcquireOptions,
    seen: { soonest: number; fits: boolean },
    booked: () => void,
  ): Promise<Acquired | "available" | "unavailable"> => {
    let available = false;
    for (const d of pickOrder(route)) {
      let got: Awaited<ReturnType<ProviderFlow["tryAcquire"]>>;
      try {
        got = await d.flows.get(route.model)!.tryAcquire(estimate, signal, jobId, tenant, booked);
      } catch (error) {
        if (error instanceof GateRefused) continue; // too large for this deployment's token limit
        throw error;
      }
      seen.fits = true;
      if ("settle" in got) {
        return { llm: clients.get(d)!.get(route.model)!, permit: got, model: route.model, deployment: d.name };
      }
      seen.soonest = Math.min(seen.soonest, got.ms);
      if (!unavailable(got)) available = true;
    }
    return available ? "available" : "unavailable";
  };

  const unavailable = (refusal: Refusal) =>
    BROKEN.has(refusal.reason) || (refusal.reason === "paused" && refusal.ms > fallbackAfterMs);

  return {
    defaultModel,
    async acquire(models, estimate, options = {}) {
      const chain = (models.length ? models : [defaultModel]).filter((m) => routes.has(m));
      if (chain.length === 0) {
        throw new GateRefused(`no deployment serves ${models.length ? models.join(", ") : defaultModel}`);
      }
      const now = performance.now();
      for (const model of chain) asked.set(model, now);
      let counted = true;
      waiting++;
      const booked = () => {
        if (counted) waiting--;
        counted = false;
      };
      try {
        for (;;) {
          options.signal?.throwIfAborted();
          const seen = { soonest: Infinity, fits: false };
          for (const [i, model] of chain.entries()) {
            const got = await tryModel(routes.get(model)!, estimate, options, seen, booked);
            if (got === "available") break; // wait for this model: it is only busy or briefly paused
            if (got === "unavailable") continue;
            if (i > 0) fellBack?.(chain[0]!, model);
            return got;
          }
          if (!seen.fits) {
            throw new GateRefused(`the call's ${estimate} estimated tokens exceed every deployment's token limit`);
          }
          // Refused (a booked slot forfeit too): waiting again.
          if (!counted) waiting++;
          counted = true;
          const ms = Number.isFinite(seen.soonest) ? seen.soonest : 100;
          // Spread the callers a pause or an open breaker releases at the same instant.
          await sleep(ms + random() * Math.min(100, ms * 0.1 + 10), options.signal);
        }
      } finally {
        if (counted) waiting--;
      }
    },
    async capacity(averageTokens) {
      const now = performance.now();
      const inUse = [...routes.values()].filter((r) => now - (asked.get(r.model) ?? -Infinity) < RECENT_MS);
      const flows = new Set<ProviderFlow>();
      for (const route of inUse.length ? inUse : routes.values()) {
        for (const d of route.deployments) flows.add(d.flows.get(route.model)!);
      }
      const each = await Promise.all([...flows].map((flow) => gates.get(flow)!(averageTokens)));
      const permits = each.reduce((sum, c) => sum + c.permits, 0) - waiting;
      if (permits > 0) return { permits, waitMs: 0 };
      return { permits: 0, waitMs: Math.max(50, Math.min(...each.map((c) => c.waitMs || 50))) };
    },
  };
}

/**
 * The order to try a model's deployments in: the next by smooth weighted round-robin (nginx's: each pick adds
 * every weight to its deployment's counter, takes the highest and takes the total off it, so weights 3 and 1 pick
 * A A B A, evenly spread), then the others by weight.
 */
function pickOrder(route: ModelRoute): RoutedDeployment[] {
  const { deployments, current } = route;
  if (deployments.length === 1) return deployments;
  let best = 0;
  for (let i = 0; i < deployments.length; i++) {
    current[i]! += deployments[i]!.weight;
    if (current[i]! > current[best]!) best = i;
  }
  current[best]! -= route.total;
  const rest = deployments.filter((_, i) => i !== best).sort((a, b) => b.weight - a.weight);
  return [deployments[best]!, ...rest];
}
