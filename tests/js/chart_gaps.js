// Sy.chart (static/ui/app.js) in Node with a recording Plotly: a gap in a time series breaks
// the line (a null inserted, hover text kept aligned), and a chart with no data says so.
// Run by tests/test_ui_charts.py: node tests/js/chart_gaps.js static/ui/app.js
const fs = require("fs");
let calls = [];
global.window = { Plotly: { react: (node, traces, layout) => calls.push({ traces, layout }) } };
global.document = { cookie: "", querySelector: () => null, addEventListener: () => {} };
const src = fs.readFileSync(process.argv[2], "utf8") + "\nmodule.exports = Sy;";
const m = { exports: {} };
new Function("module", "require", src)(m, require);
const Sy = m.exports;
const x = ["2026-11-28 10:00:00", "2026-11-28 10:01:00", "2026-11-28 10:02:00", "2026-11-28 10:30:00", "2026-11-28 10:31:00"];
Sy.chart("n", [{ x, y: [1, 2, 3, 4, 5], mode: "lines", text: ["a", "b", "c", "d", "e"] }], {});
const t = calls[0].traces[0];
console.log(JSON.stringify(t.x), JSON.stringify(t.y), JSON.stringify(t.text), t.connectgaps);
if (JSON.stringify(t.y) !== "[1,2,3,null,4,5]") throw new Error("no break");
Sy.chart("n", [{ x: [], y: [], mode: "lines" }, { x, y: [null, null, null, null, null] }], {});
const l = calls[1].layout;
if (!l.annotations || l.annotations[0].text !== "no data yet") throw new Error("no empty note");
console.log("ok");
