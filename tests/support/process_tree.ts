/** The processes below a process, found through `ps` and `/proc` (the tests and the bench may run programs). */

/** The pids of the processes whose parent is `pid`. */
export async function childrenOf(pid: number): Promise<number[]> {
  const out = await new Deno.Command("ps", { args: ["-o", "pid=", "--ppid", String(pid)], stdout: "piped" }).output();
  return new TextDecoder().decode(out.stdout).split("\n").map((s) => Number(s.trim())).filter((n) => n > 0);
}

/** The command line of `pid`, its arguments separated by spaces ("" once it is gone). */
export async function commandLine(pid: number): Promise<string> {
  const out = await new Deno.Command("cat", { args: [`/proc/${pid}/cmdline`], stdout: "piped", stderr: "null" })
    .output();
  return new TextDecoder().decode(out.stdout).replaceAll("\0", " ");
}

/** Every process below `pid` whose command line matches `pattern`, the search stopping at each match. */
export async function descendantsMatching(pid: number, pattern: RegExp): Promise<number[]> {
  const found: number[] = [];
  for (const child of await childrenOf(pid)) {
    if (pattern.test(await commandLine(child))) found.push(child);
    else found.push(...await descendantsMatching(child, pattern));
  }
  return found;
}

/** Whether process `pid` still exists (a zombie counts as gone). */
export async function isRunning(pid: number): Promise<boolean> {
  const out = await new Deno.Command("cat", { args: [`/proc/${pid}/stat`], stdout: "piped", stderr: "null" }).output();
  if (!out.success) return false;
  const stat = new TextDecoder().decode(out.stdout);
  return stat.slice(stat.lastIndexOf(")") + 2, stat.lastIndexOf(")") + 3) !== "Z";
}
