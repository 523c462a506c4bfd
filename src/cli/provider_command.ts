import type { ProviderFlow, ProviderStatus } from "../provider/flow_control.ts";

const USAGE = "Usage: deno task provider status [--json]";

const when = (at: number | null, now: number) => {
  if (at === null) return "-";
  const ms = at - now;
  return `${new Date(at).toISOString()} (${ms >= 0 ? "in " : ""}${Math.abs(ms / 1000).toFixed(1)} s${
    ms < 0 ? " ago" : ""
  })`;
};

const limitLine = (name: string, l: ProviderStatus["rpm"], remaining: number | null) =>
  `${name.padEnd(16)}${l.limit === null ? "unlimited" : String(l.limit)}` +
  `  (source: ${l.source}; configured ${l.configured ?? "-"}, from headers ${l.learned ?? "-"})` +
  `  remaining per headers: ${remaining ?? "-"}`;

/** Renders a provider's shared state for people. */
export function formatProviderStatus(s: ProviderStatus, provider: string): string[] {
  return [
    `provider        ${provider}`,
    `state key       ${s.key}`,
    limitLine("requests/min", s.rpm, s.remaining.requests),
    limitLine("tokens/min", s.tpm, s.remaining.tokens),
    `configured by   ${
      s.configured_by.length === 0
        ? "no live worker"
        : s.configured_by.map((c) =>
          `rpm ${c.rpm ?? "-"} tpm ${c.tpm ?? "-"} (live until ${when(c.expires_at, s.now)})`
        ).join("; ")
    }`,
    `headers         ${s.headers.at === null ? "no limits heard" : `limits last heard ${when(s.headers.at, s.now)}`}${
      s.headers.stopped_at === null ? "" : `; stopped ${when(s.headers.stopped_at, s.now)}`
    }`,
    `learning        ${s.learning ? "yes: one call at a time until the provider's headers give the limits" : "no"}`,
    `requests reset  ${when(s.reset.requests_at, s.now)}`,
    `tokens reset    ${when(s.reset.tokens_at, s.now)}`,
    `next permit     ${s.next_permit_at <= s.now ? "now" : when(s.next_permit_at, s.now)}`,
    `pause           ${s.pause.until === null ? "none" : `${s.pause.reason} until ${when(s.pause.until, s.now)}`}`,
    `breaker         ${s.breaker.state}${s.breaker.reason ? ` (${s.breaker.reason})` : ""}` +
    `${s.breaker.cause && s.breaker.cause !== s.breaker.reason ? `, opened for ${s.breaker.cause}` : ""}` +
    `, next wait ${(s.breaker.cooldown_ms / 1000).toFixed(1)} s`,
    `evidence        ${s.breaker.failures} jobs failing since the last success (${s.breaker.wide_failures} in ways ` +
    `no document causes, ${s.breaker.tenants} tenants); failing share of the last 10 s ${
      s.breaker.failing_share === null ? "-" : `${Math.round(s.breaker.failing_share * 100)}%`
    }`,
    ...(s.breaker.state === "closed"
      ? []
      : [`                opened ${when(s.breaker.opened_at, s.now)}, probe ${when(s.breaker.probe_at, s.now)}`]),
    `failures        ${s.recent_failures.provider} charged to the provider, ${s.recent_failures.job} to their jobs` +
    (s.recent_failures.since === null ? " (none recently)" : ` (since ${when(s.recent_failures.since, s.now)})`),
  ];
}

/** Several flows' states for people, each under its own label, a blank line between them. */
export async function formatProviderStatuses(
  flows: readonly { label: string; flow: ProviderFlow }[],
): Promise<string[]> {
  const statuses = await Promise.all(flows.map((f) => f.flow.status()));
  return statuses.flatMap((status, i) => [...(i ? [""] : []), ...formatProviderStatus(status, flows[i]!.label)]);
}

/**
 * `provider status [--json]`: the shared limiter and breaker of the configured model provider, with where each
 * limit came from; with LLM_DEPLOYMENTS, of each model of each deployment (`--json`: an array of them, each with
 * its `deployment` and `model`).
 * @returns the process exit code.
 */
export async function providerCommand(
  flows: ProviderFlow | undefined | readonly FlowLike[],
  provider: string,
  args: string[],
  out: (line: string) => void = console.log,
): Promise<number> {
  if (args[0] !== "status" || args.slice(1).some((a) => a !== "--json")) {
    console.error(USAGE);
    return 2;
  }
  const list: readonly FlowLike[] = flows === undefined
    ? []
    : "status" in flows
    ? [{ deployment: undefined, model: "", label: provider, flow: flows }]
    : flows;
  if (list.length === 0) {
    out(`The model provider is ${provider}: a local model with no shared limiter or breaker.`);
    return 0;
  }
  const json = args.includes("--json");
  if (list.length === 1 && list[0]!.deployment === undefined) {
    const status = await list[0]!.flow.status();
    if (json) out(JSON.stringify({ provider: list[0]!.label, ...status }));
    else for (const line of formatProviderStatus(status, list[0]!.label)) out(line);
    return 0;
  }
  if (!json) {
    for (const line of await formatProviderStatuses(list)) out(line);
    return 0;
  }
  const statuses = await Promise.all(list.map((f) => f.flow.status()));
  out(JSON.stringify(statuses.map((status, i) => {
    const { deployment, model, label } = list[i]!;
    return { deployment, model, provider: label, ...status };
  })));
  return 0;
}

/** One flow as `provider status` lists it. */
interface FlowLike {
  deployment: string | undefined;
  model: string;
  label: string;
  flow: ProviderFlow;
}
