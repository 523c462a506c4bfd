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

/**
 * `provider status [--json]`: the shared limiter and breaker of the
 * configured model provider, with where each limit came from.
 * @returns the process exit code.
 */
export async function providerCommand(
  flow: ProviderFlow | undefined,
  provider: string,
  args: string[],
  out: (line: string) => void = console.log,
): Promise<number> {
  if (args[0] !== "status" || args.slice(1).some((a) => a !== "--json")) {
    console.error(USAGE);
    return 2;
  }
  if (!flow) {
    out(`The model provider is ${provider}: a local model with no shared limiter or breaker.`);
    return 0;
  }
  const status = await flow.status();
  if (args.includes("--json")) out(JSON.stringify({ provider, ...status }));
  else for (const line of formatProviderStatus(status, provider)) out(line);
  return 0;
}
