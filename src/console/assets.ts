/** The console's stylesheet and its one small script, served from `/console/app.css` and `/console/app.js`. */

export const CSS = `
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}
header{display:flex;gap:1rem;align-items:center;flex-wrap:wrap;padding:.6rem 1rem;background:#1b2a41;color:#fff}
header a{color:#cfe0ff;margin-right:.6rem} header form{display:inline} main{padding:1rem 1.5rem}
table{border-collapse:collapse;background:#fff;width:100%} th,td{border-bottom:1px solid #e3e6ea;padding:.35rem .5rem;text-align:left;vertical-align:top}
th{background:#eef1f5} .reason,.excerpt{font-family:ui-monospace,monospace;font-size:12px;word-break:break-all}
.note{background:#fff7d6;border:1px solid #e8d48a;padding:.4rem .6rem} .empty{color:#667}
.figures{display:grid;grid-template-columns:max-content 1fr;gap:.2rem 1rem} .figures dt{color:#556}
form.inline{display:inline} pre{background:#fff;border:1px solid #e3e6ea;padding:.6rem;white-space:pre-wrap}
.login{max-width:24rem;margin:4rem auto}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1rem;margin:1rem 0}
figure.plot{margin:0;background:#fff;border:1px solid #e3e6ea;padding:.5rem} figure.plot figcaption{font-weight:600}
svg.chart{display:block;width:100%;height:auto} figure.plot summary{color:#556;cursor:pointer}
form.selector{margin:.4rem 0} .switch{color:#556}
`;

export const JS = `
// Optional: reload the page every 5 s while the box is ticked (remembered in this browser).
const box = document.getElementById("auto-refresh");
if (box) {
  box.checked = localStorage.getItem("oncely-console-refresh") === "1";
  box.addEventListener("change", () => localStorage.setItem("oncely-console-refresh", box.checked ? "1" : "0"));
  setInterval(() => { if (box.checked) location.reload(); }, 5000);
}
`;

/** The answer for `/console/app.css` or `/console/app.js`; null for any other path. */
export function asset(path: string): Response | null {
  if (path === "/console/app.css") {
    return new Response(CSS, { headers: { "content-type": "text/css", "cache-control": "max-age=300" } });
  }
  if (path === "/console/app.js") {
    return new Response(JS, { headers: { "content-type": "text/javascript", "cache-control": "max-age=300" } });
  }
  return null;
}
