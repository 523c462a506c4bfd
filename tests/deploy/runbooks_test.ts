/**
 * deploy/prometheus/alerts.yml and the README agree: every alert carries a `runbook` annotation naming the README's
 * "Runbooks" line of its name, has that line, and is a row of the README's alert table with its severity; and the
 * README names no alert the rules do not have (a renamed or removed alert leaves no stale line or row behind).
 */
import assert from "node:assert/strict";
import { parse } from "npm:yaml@2.8.1";

const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);

type Rule = { alert?: string; labels?: Record<string, string>; annotations?: Record<string, string> };
type Alert = { name: string; severity?: string; runbook?: string };

/** The alerts of alerts.yml, with their severity label and runbook annotation. */
async function alerts(): Promise<Alert[]> {
  const doc = parse(await Deno.readTextFile(`${ROOT}deploy/prometheus/alerts.yml`)) as { groups: { rules: Rule[] }[] };
  return doc.groups.flatMap((g) =>
    g.rules.flatMap((r) =>
      r.alert === undefined ? [] : [{ name: r.alert, severity: r.labels?.severity, runbook: r.annotations?.runbook }]
    )
  );
}

/** The lines of README.md from the heading `heading` (exactly) to the next heading of the same or a higher level. */
function section(readme: string[], heading: string): string[] {
  const start = readme.indexOf(heading);
  assert.notEqual(start, -1, `README.md has no heading "${heading}"`);
  const level = heading.indexOf(" ");
  const end = readme.findIndex((line, i) => i > start && /^#+ /.test(line) && line.indexOf(" ") <= level);
  return readme.slice(start + 1, end === -1 ? undefined : end);
}

/** The README's alert table (header `| alert | fires when | severity |`): alert name → severity. */
function alertTable(lines: string[]): Map<string, string> {
  const header = lines.findIndex((l) => /^\|\s*alert\s*\|\s*fires when\s*\|\s*severity\s*\|$/.test(l.trim()));
  assert.notEqual(header, -1, 'README.md\'s "Monitoring" section has no table "| alert | fires when | severity |"');
  const rows = new Map<string, string>();
  for (const line of lines.slice(header + 2)) {
    if (!line.startsWith("|")) break;
    const cells = line.split("|").slice(1, -1).map((c) => c.trim());
    const name = /^`([^`]+)`$/.exec(cells[0] ?? "")?.[1];
    assert.ok(name, `README.md's alert table has a row whose first cell is not an alert name: ${line}`);
    rows.set(name, cells[2] ?? "");
  }
  return rows;
}

/** The README's "Runbooks" lines that open with a bold alert name (`**OncelyX** ...`): alert name → the rest. */
function runbookLines(lines: string[]): Map<string, string> {
  const runbooks = new Map<string, string>();
  for (const line of lines) {
    const m = /^\*\*(Oncely[A-Za-z]+)\*\*(.*)$/.exec(line);
    if (m) runbooks.set(m[1]!, m[2]!.trim());
  }
  return runbooks;
}

const readme = async () => (await Deno.readTextFile(`${ROOT}README.md`)).split("\n");

Deno.test("every alert has a runbook annotation naming the README's Runbooks line of its own name", async () => {
  const all = await alerts();
  assert.ok(all.length > 0, "deploy/prometheus/alerts.yml has no alert");
  for (const { name, runbook } of all) {
    assert.ok(runbook !== undefined, `alert ${name} in deploy/prometheus/alerts.yml has no runbook annotation`);
    assert.equal(
      runbook,
      `README.md#runbooks: ${name}`,
      `alert ${name}'s runbook annotation does not name its README line ("README.md#runbooks: ${name}")`,
    );
  }
});

Deno.test('every alert has a runbook line under the README\'s "## Runbooks", and every such line an alert', async () => {
  const all = await alerts();
  const runbooks = runbookLines(section(await readme(), "## Runbooks"));
  for (const { name } of all) {
    assert.ok(
      runbooks.has(name),
      `alert ${name} has no runbook line (a paragraph starting "**${name}**") under README.md's "## Runbooks"`,
    );
    assert.ok(runbooks.get(name)!.length > 20, `alert ${name}'s runbook line under "## Runbooks" says nothing`);
  }
  const names = new Set(all.map((a) => a.name));
  for (const name of runbooks.keys()) {
    assert.ok(names.has(name), `README.md's "## Runbooks" has a line for ${name}, which alerts.yml does not define`);
  }
});

Deno.test("every alert is a row of the README's alert table with its severity, and every row an alert", async () => {
  const all = await alerts();
  const table = alertTable(section(await readme(), "### Monitoring: Prometheus, alerts, Grafana (`deploy/`)"));
  for (const { name, severity } of all) {
    assert.ok(
      table.has(name),
      `alert ${name} is missing from README.md's alert table (| alert | fires when | severity |)`,
    );
    assert.equal(
      table.get(name),
      severity,
      `alert ${name}: README.md's alert table says severity "${table.get(name)}", alerts.yml says "${severity}"`,
    );
  }
  const names = new Set(all.map((a) => a.name));
  for (const name of table.keys()) {
    assert.ok(names.has(name), `README.md's alert table has a row for ${name}, which alerts.yml does not define`);
  }
});

Deno.test("the checks have teeth: without its runbook line and table row, an alert is not found; nor past the section", async () => {
  const lines = await readme();
  const runbooks = runbookLines(section(lines, "## Runbooks"));
  const table = alertTable(section(lines, "### Monitoring: Prometheus, alerts, Grafana (`deploy/`)"));
  // A README without OncelyBreakerOpen's runbook line and table row no longer has them.
  const without = lines.filter((l) => !l.startsWith("**OncelyBreakerOpen**") && !l.startsWith("| `OncelyBreakerOpen`"));
  assert.ok(runbooks.has("OncelyBreakerOpen") && table.has("OncelyBreakerOpen"));
  assert.ok(!runbookLines(section(without, "## Runbooks")).has("OncelyBreakerOpen"));
  assert.ok(
    !alertTable(section(without, "### Monitoring: Prometheus, alerts, Grafana (`deploy/`)")).has("OncelyBreakerOpen"),
  );
  // A runbook line past the section's end does not count.
  assert.ok(!runbookLines(section([...lines, "## Later", "**OncelyX** a line"], "## Runbooks")).has("OncelyX"));
});
