/**
 * Process metrics on every process's `/metrics`: the ones `prom-client`'s
 * `collectDefaultMetrics` makes (CPU, start time, heap and heap spaces, event
 * loop lag, external memory, version), and, where its way of reading them does
 * not work under Deno, the same names read through Deno's own API.
 *
 * Under Deno 2.9 and the service's permission sets, `collectDefaultMetrics`
 * reads `/proc/self/status` and `/proc/self/fd` for resident memory, virtual
 * memory, `process_heap_bytes` and open descriptors: the sets grant no file
 * reads, so it reports 0 for each, silently. Node's active handles and
 * requests (`process._getActiveHandles`) do not exist in Deno: always 0; its
 * active resources name only timers. Those series are dropped rather than
 * exported as a false figure, and resident memory is read from
 * `Deno.memoryUsage()` (no permission needed).
 */
import { collectDefaultMetrics, Gauge, type Registry } from "prom-client";

/** Series `collectDefaultMetrics` makes that read nothing true under Deno and the service's permission sets. */
const UNTRUE_UNDER_DENO = [
  "process_resident_memory_bytes",
  "process_virtual_memory_bytes",
  "process_heap_bytes",
  "process_open_fds",
  "process_max_fds",
  "nodejs_active_handles",
  "nodejs_active_handles_total",
  "nodejs_active_requests",
  "nodejs_active_requests_total",
  // Deno's process.getActiveResourcesInfo names only some of its resources (timers, not sockets or files); and
  // these gauges' `_total` suffix fails `promtool check metrics`.
  "nodejs_active_resources",
  "nodejs_active_resources_total",
] as const;

/**
 * Registers the process metrics on `registry`, once (a second call, as `dev`'s components share a registry, adds
 * nothing). It keeps an event-loop delay monitor running for the life of the process.
 */
export function processMetrics(registry: Registry): void {
  if (registry.getSingleMetric("process_cpu_seconds_total")) return;
  collectDefaultMetrics({ register: registry, eventLoopMonitoringPrecision: 10 });
  for (const name of UNTRUE_UNDER_DENO) registry.removeSingleMetric(name);
  new Gauge({
    name: "process_resident_memory_bytes",
    help: "Resident memory size in bytes.",
    registers: [registry],
    collect() {
      this.set(Deno.memoryUsage().rss);
    },
  });
}
