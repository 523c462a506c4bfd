/** CPU time per thread of this process, to show work done on another thread rather than this one. */

/** CPU time (user and system) each thread of this process has used, in ms (10 ms steps), by thread id. */
export async function threadsCpuMs(): Promise<Map<string, number>> {
  // Read by a shell: Deno opens /proc itself only with --allow-all.
  const script = `for t in /proc/${Deno.pid}/task/*; do echo "\${t##*/} $(cut -d')' -f2 "$t/stat")"; done`;
  const out = await new Deno.Command("sh", { args: ["-c", script], stdout: "piped" }).output();
  const lines = new TextDecoder().decode(out.stdout).trim().split("\n");
  return new Map(lines.map((line) => {
    const [tid, ...fields] = line.trim().split(/\s+/);
    // After the name: state, ppid, ..., utime (the 12th), stime (the 13th), in clock ticks of 10 ms.
    return [tid!, (Number(fields[11]) + Number(fields[12])) * 10];
  }));
}

/** The id of the thread this code runs on (deno test runs it on one of its runtime's threads): the busiest. */
export async function thisThread(): Promise<string> {
  const before = await threadsCpuMs();
  const started = performance.now();
  while (performance.now() - started < 200) { /* busy */ }
  const after = await threadsCpuMs();
  return [...after].sort((a, b) => (b[1] - (before.get(b[0]) ?? 0)) - (a[1] - (before.get(a[0]) ?? 0)))[0]![0];
}
