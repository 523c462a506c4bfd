/** Debian's `promtool` (package `prometheus`, which `.ci/run` installs), for the deploy and metrics tests. */

/** Why promtool cannot run here, or undefined when it can. */
export async function promtoolMissing(): Promise<string | undefined> {
  const ok = await new Deno.Command("promtool", { args: ["--version"], stdout: "null", stderr: "null" }).output()
    .then((o) => o.success, () => false);
  return ok ? undefined : "promtool is not installed (Debian: prometheus)";
}

/** Runs promtool with `args` (and `stdin`). @returns its exit code and its output, stdout then stderr. */
export async function promtool(args: string[], stdin?: string): Promise<{ code: number; out: string }> {
  const child = new Deno.Command("promtool", {
    args,
    stdin: stdin === undefined ? "null" : "piped",
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  if (stdin !== undefined) {
    const writer = child.stdin.getWriter();
    await writer.write(new TextEncoder().encode(stdin));
    await writer.close();
  }
  const { code, stdout, stderr } = await child.output();
  return { code, out: new TextDecoder().decode(stdout) + new TextDecoder().decode(stderr) };
}
