/**
 * A definition checker nobody closes does not keep its process alive: its Worker stops once idle (the bench's API
 * server, which never closed it, hung at exit).
 */
import assert from "node:assert/strict";

Deno.test("a process whose definition checker is never closed exits once the checker is idle", async () => {
  const script = new URL("../support/definition_check_exit.ts", import.meta.url).pathname;
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "--allow-read", `--allow-run=${Deno.execPath()}`, script],
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const killer = setTimeout(() => child.kill("SIGKILL"), 10_000);
  try {
    const { code, stdout, stderr } = await child.output();
    assert.equal(new TextDecoder().decode(stdout).trim(), "checked", new TextDecoder().decode(stderr));
    assert.equal(code, 0, "exited by itself, within 10 s (idleMs is 200 ms)");
  } finally {
    clearTimeout(killer);
  }
});
