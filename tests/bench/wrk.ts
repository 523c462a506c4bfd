/**
 * HTTP load from `wrk` (Debian's package), a C load generator that does not
 * share Deno's limits: a Deno `fetch` loop tops out near 7,000 requests/s on
 * these machines, far below a bare `Deno.serve` handler. Installed on first
 * use when missing and possible; otherwise the caller falls back to the Deno
 * closed loop and says so.
 */
import { closedLoop } from "./load.ts";
import { quantile } from "./stats.ts";

/** What one load run measured. */
export interface HttpLoad {
  perSecond: number;
  p50: number;
  p99: number;
  /** Answers other than the expected status, and socket errors. */
  errors: number;
  generator: "wrk" | "deno-fetch";
}

/** A POST every connection repeats, with a header that may vary per request. */
export interface PostLoad {
  url: string;
  headers: Record<string, string>;
  body: string;
  /** A header whose value is `${prefix}${thread}-${counter}` (unique per request), or one fixed value. */
  vary?: { header: string; prefix: string };
  /** A header whose value is `${prefix}${n}`, `n` drawn at random from 1 to `count` per request (say, a tenant). */
  spread?: { header: string; prefix: string; count: number };
  connections: number;
  seconds: number;
  expectStatus: number;
}

let wrkPath: string | null | undefined;

/** The path of `wrk`, installing Debian's package when missing and running as root. */
export async function findWrk(progress: (msg: string) => void = () => {}): Promise<string | null> {
  if (wrkPath !== undefined) return wrkPath;
  const which = async () => {
    const out = await new Deno.Command("sh", { args: ["-c", "command -v wrk"], stdout: "piped" }).output();
    return out.success ? new TextDecoder().decode(out.stdout).trim() : null;
  };
  wrkPath = await which();
  if (wrkPath === null && Deno.uid() === 0) {
    progress("wrk is missing: apt-get install -y wrk");
    await new Deno.Command("sh", {
      args: ["-c", "(apt-get install -y wrk || (apt-get update && apt-get install -y wrk)) >/dev/null 2>&1"],
    }).output();
    wrkPath = await which();
  }
  return wrkPath;
}

function luaString(s: string): string {
  return JSON.stringify(s); // a JSON string literal is a valid Lua string literal for this ASCII content
}

/** Parses wrk's `--latency` report; latencies in ms. */
export function parseWrk(text: string): { perSecond: number; p50: number; p99: number; errors: number } {
  const unit = (value: string, u: string) => Number(value) * (u === "us" ? 0.001 : u === "s" ? 1000 : 1);
  const pct = (p: string) => {
    const m = new RegExp(`^\\s*${p}%\\s+([\\d.]+)(us|ms|s)\\s*$`, "m").exec(text);
    return m ? unit(m[1]!, m[2]!) : NaN;
  };
  const rps = /Requests\/sec:\s+([\d.]+)/.exec(text);
  const non2xx = /Non-2xx or 3xx responses:\s+(\d+)/.exec(text);
  const socket = /Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)/.exec(text);
  const socketErrors = socket ? socket.slice(1).reduce((n, x) => n + Number(x), 0) : 0;
  return {
    perSecond: rps ? Number(rps[1]) : NaN,
    p50: pct("50"),
    p99: pct("99"),
    errors: (non2xx ? Number(non2xx[1]) : 0) + socketErrors,
  };
}

/** Runs one POST load with wrk, or with the Deno closed loop when wrk cannot be had. */
export async function postLoad(load: PostLoad, progress: (msg: string) => void = () => {}): Promise<HttpLoad> {
  const wrk = await findWrk(progress);
  if (!wrk) {
    const result = await closedLoop((i) =>
      new Request(load.url, {
        method: "POST",
        headers: {
          ...load.headers,
          ...(load.vary ? { [load.vary.header]: `${load.vary.prefix}0-${i}` } : {}),
          ...(load.spread
            ? { [load.spread.header]: `${load.spread.prefix}${1 + Math.floor(Math.random() * load.spread.count)}` }
            : {}),
        },
        body: load.body,
      }), { connections: load.connections, seconds: load.seconds });
    const wrong = Object.entries(result.statuses).filter(([s]) => Number(s) !== load.expectStatus)
      .reduce((n, [, c]) => n + c, 0);
    return {
      perSecond: result.perSecond,
      p50: quantile(result.latenciesMs, 0.5),
      p99: quantile(result.latenciesMs, 0.99),
      errors: result.errors + wrong,
      generator: "deno-fetch",
    };
  }
  const headerLines = Object.entries(load.headers).map(([k, v]) => `wrk.headers[${luaString(k)}] = ${luaString(v)}`);
  const script = `
wrk.method = "POST"
wrk.body = ${luaString(load.body)}
${headerLines.join("\n")}
local counter = 0
local thread_id = 0
local threads = 0
function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end
function init(args)
  thread_id = tid
  math.randomseed(os.time() * 100 + thread_id)
end
${
    load.vary || load.spread
      ? `function request()
  counter = counter + 1
  -- wrk.format replaces wrk.headers with the table it is given, so copy them first.
  local headers = {}
  for k, v in pairs(wrk.headers) do headers[k] = v end
  ${
        load.vary
          ? `headers[${luaString(load.vary.header)}] = ${luaString(load.vary.prefix)} .. thread_id .. "-" .. counter`
          : ""
      }
  ${
        load.spread
          ? `headers[${luaString(load.spread.header)}] = ${luaString(load.spread.prefix)} .. math.random(${
            Math.trunc(load.spread.count)
          })`
          : ""
      }
  return wrk.format(nil, nil, headers)
end`
      : ""
  }
`;
  const file = await Deno.makeTempFile({ suffix: ".lua" });
  try {
    await Deno.writeTextFile(file, script);
    const out = await new Deno.Command(wrk, {
      args: [
        "-t2",
        `-c${load.connections}`,
        `-d${load.seconds}s`,
        "--latency",
        "-s",
        file,
        load.url,
      ],
      stdout: "piped",
      stderr: "piped",
    }).output();
    const text = new TextDecoder().decode(out.stdout);
    if (!out.success) throw new Error(`wrk failed: ${new TextDecoder().decode(out.stderr).slice(0, 500)}`);
    return { ...parseWrk(text), generator: "wrk" };
  } finally {
    await Deno.remove(file).catch(() => {});
  }
}
