/**
 * One trace per job, across processes. With `OTEL_DENO=true` Deno exports
 * its own spans (each `Deno.serve` request, each `fetch`) and registers the
 * providers behind `@opentelemetry/api`, so the spans made here join them.
 * The W3C `traceparent` of the POST travels in the stream message, and that
 * of the delivery that committed the job travels in the outbox row, so the
 * worker and the relay continue the API's trace. Without `OTEL_DENO`, the
 * API is a no-op: no context to inject, no field added, no span recorded.
 */
import {
  type Context,
  context,
  INVALID_SPAN_CONTEXT,
  propagation,
  ProxyTracerProvider,
  type Span,
  SpanStatusCode,
  trace,
} from "@opentelemetry/api";

const tracer = trace.getTracer("oncely");

/** The provider `@opentelemetry/api` falls back to while none is registered. */
const NOOP_PROVIDER = new ProxyTracerProvider().getDelegate();
/** The span `fn` gets when nothing is traced. */
const NOOP_SPAN = trace.wrapSpanContext(INVALID_SPAN_CONTEXT);

/**
 * Whether a tracer provider is registered (Deno registers its own with `OTEL_DENO=true`). Without one, a span
 * would be a no-op that still costs its attributes, a context and a closure, which showed in the worker's profile
 * under load (see README, "Per-job cost of the worker (issue 26)").
 */
function tracing(): boolean {
  const provider = trace.getTracerProvider();
  return !(provider instanceof ProxyTracerProvider) || provider.getDelegate() !== NOOP_PROVIDER;
}

/** The active context's `traceparent`, or undefined when nothing is being traced. */
export function currentTraceparent(): string | undefined {
  if (!tracing()) return undefined;
  const carrier: Record<string, string> = {};
  propagation.inject(context.active(), carrier);
  return carrier.traceparent;
}

/** The context a `traceparent` names (the active one when there is none). */
export function contextFrom(traceparent: string | undefined): Context {
  if (!traceparent) return context.active();
  return propagation.extract(context.active(), { traceparent });
}

/** The trace id a `traceparent` names, for links to a trace. */
export function traceIdOf(traceparent: string | undefined): string | undefined {
  return /^00-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$/.exec(traceparent ?? "")?.[1];
}

/**
 * Runs `fn` in a new active span named `name` under `parent`, ending it when
 * `fn` settles and marking it failed when `fn` throws.
 */
export function inSpan<T>(
  name: string,
  attributes: Record<string, string | number | boolean | undefined>,
  fn: (span: Span) => Promise<T>,
  parent?: Context,
): Promise<T> {
  if (!tracing()) return fn(NOOP_SPAN);
  return tracer.startActiveSpan(name, { attributes: defined(attributes) }, parent ?? context.active(), async (span) => {
    try {
      return await fn(span);
    } catch (error) {
      span.setStatus({ code: SpanStatusCode.ERROR, message: error instanceof Error ? error.name : String(error) });
      throw error;
    } finally {
      span.end();
    }
  });
}

/** Records a span that already happened (from `startMs` to `endMs`, epoch ms) under `parent`. */
export function recordSpan(
  name: string,
  { startMs, endMs, attributes, failed = false, parent = context.active() }: {
    startMs: number;
    endMs: number;
    attributes: Record<string, string | number | boolean | undefined>;
    failed?: boolean;
    parent?: Context;
  },
): void {
  if (!tracing()) return;
  const span = tracer.startSpan(name, { startTime: startMs, attributes: defined(attributes) }, parent);
  if (failed) span.setStatus({ code: SpanStatusCode.ERROR });
  span.end(endMs);
}

function defined(attributes: Record<string, string | number | boolean | undefined>) {
  return Object.fromEntries(Object.entries(attributes).filter(([, v]) => v !== undefined)) as Record<
    string,
    string | number | boolean
  >;
}
