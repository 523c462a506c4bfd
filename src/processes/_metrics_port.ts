import type { Registry } from "prom-client";
import type { Config } from "../config.ts";
import { serveMetrics } from "../metrics/metrics.ts";

/** Serves a standalone process's /metrics, /healthz and, given `ready`, /readyz on METRICS_PORT, when set. */
export function maybeServeMetrics(
  config: Config,
  registry: Registry,
  signal: AbortSignal,
  ready?: () => Promise<Response>,
): void {
  if (config.METRICS_PORT === undefined) return;
  serveMetrics(registry, {
    hostname: config.HOST,
    port: config.METRICS_PORT,
    signal,
    token: config.METRICS_TOKEN,
    ready,
  });
}
