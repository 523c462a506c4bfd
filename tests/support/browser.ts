/**
 * Headless Chromium (Debian's `chromium`) driven over the Chrome DevTools
 * Protocol with Deno's own WebSocket: navigate, run script in the page,
 * click, take screenshots. Just enough for the console's tests.
 */

/** A page in a headless browser. */
export interface Browser {
  /** Loads `url` and waits for its load event. @returns the URL it ended on (after redirects). */
  goto(url: string): Promise<string>;
  /** Evaluates `expression` in the page and returns its (JSON) value. */
  eval<T = unknown>(expression: string): Promise<T>;
  /** Runs `expression` (which should click or submit) and waits for the navigation it causes. */
  navigateBy(expression: string): Promise<string>;
  screenshot(path: string): Promise<void>;
  close(): Promise<void>;
}

const CANDIDATES = ["/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"];

/** The system's Chromium, or undefined. */
export function findChromium(): string | undefined {
  return CANDIDATES.find((p) => {
    try {
      return Deno.statSync(p).isFile;
    } catch {
      return false;
    }
  });
}

/** Starts headless Chromium with a fresh profile and opens one page. */
export async function launchBrowser(executable = findChromium()): Promise<Browser> {
  if (!executable) throw new Error("Chromium is needed (apt-get install -y chromium; .ci/run installs it)");
  const profile = await Deno.makeTempDir({ prefix: "oncely-chromium-" });
  const child = new Deno.Command(executable, {
    args: [
      "--headless=new",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-dev-shm-usage",
      "--no-first-run",
      "--remote-debugging-address=127.0.0.1",
      "--remote-debugging-port=0",
      `--user-data-dir=${profile}`,
      "--window-size=1280,900",
      "about:blank",
    ],
    stdout: "null",
    stderr: "piped",
  }).spawn();
  // Chromium announces its DevTools endpoint on stderr.
  const reader = child.stderr.pipeThrough(new TextDecoderStream()).getReader();
  let seen = "";
  const deadline = Date.now() + 20_000;
  let port: string | undefined;
  while (!port) {
    const { value, done } = await reader.read();
    if (done || Date.now() > deadline) throw new Error(`Chromium did not start: ${seen.slice(-500)}`);
    seen += value;
    port = /DevTools listening on ws:\/\/127\.0\.0\.1:(\d+)\//.exec(seen)?.[1];
  }
  const drained = (async () => {
    while (!(await reader.read()).done) { /* keep the pipe empty */ }
  })().catch(() => {});
  const targets = await (await fetch(`http://127.0.0.1:${port}/json/list`)).json() as {
    type: string;
    webSocketDebuggerUrl: string;
  }[];
  const target = targets.find((t) => t.type === "page")!;
  const socket = new WebSocket(target.webSocketDebuggerUrl);
  await new Promise((resolve, reject) => {
    socket.onopen = resolve;
    socket.onerror = reject;
  });
  let nextId = 1;
  const pending = new Map<number, { resolve(v: unknown): void; reject(e: Error): void }>();
  const listeners = new Set<(method: string, params: unknown) => void>();
  socket.onmessage = (event) => {
    const message = JSON.parse(event.data as string);
    if (message.id !== undefined) {
      const waiter = pending.get(message.id);
      pending.delete(message.id);
      if (message.error) waiter?.reject(new Error(`${message.error.message} (${message.error.code})`));
      else waiter?.resolve(message.result);
    } else {
      for (const listen of listeners) listen(message.method, message.params);
    }
  };
  const send = <T>(method: string, params: Record<string, unknown> = {}) =>
    new Promise<T>((resolve, reject) => {
      const id = nextId++;
      pending.set(id, { resolve: resolve as (v: unknown) => void, reject });
      socket.send(JSON.stringify({ id, method, params }));
    });
  const loaded = () =>
    new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error("page did not load within 15 s")), 15_000);
      const listen = (method: string) => {
        if (method !== "Page.loadEventFired") return;
        clearTimeout(timer);
        listeners.delete(listen);
        resolve();
      };
      listeners.add(listen);
    });
  await send("Page.enable");
  await send("Runtime.enable");
  const evaluate = async <T>(expression: string): Promise<T> => {
    const result = await send<{ result: { value: T }; exceptionDetails?: { text: string } }>("Runtime.evaluate", {
      expression,
      returnByValue: true,
      awaitPromise: true,
    });
    if (result.exceptionDetails) throw new Error(`in the page: ${result.exceptionDetails.text}`);
    return result.result.value;
  };
  return {
    async goto(url) {
      const load = loaded();
      await send("Page.navigate", { url });
      await load;
      return await evaluate<string>("location.href");
    },
    eval: evaluate,
    async navigateBy(expression) {
      const load = loaded();
      await evaluate(expression);
      await load;
      return await evaluate<string>("location.href");
    },
    async screenshot(path) {
      const { data } = await send<{ data: string }>("Page.captureScreenshot", {
        format: "png",
        captureBeyondViewport: true,
      });
      await Deno.writeFile(path, Uint8Array.from(atob(data), (c) => c.charCodeAt(0)));
    },
    async close() {
      socket.close();
      child.kill("SIGKILL");
      await child.status;
      await drained;
      await Deno.remove(profile, { recursive: true }).catch(() => {});
    },
  };
}
