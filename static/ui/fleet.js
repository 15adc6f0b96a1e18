// Fleet page: a replicas-over-time chart per deployment from the embedded decisions, and a
// refresh every 5 s that fetches the page again and swaps in its changed parts, so the template
// stays the one renderer of the tables.
"use strict";

const REFRESH_MS = 5000;
const TRACES = [
  { key: "desired", name: "desired", color: "#4c6ef5", dash: "solid", mode: "lines" },
  { key: "accepted", name: "accepted by the cluster", color: "#12b886", dash: "solid", mode: "markers" },
  { key: "actual", name: "live replicas", color: "#f08c00", dash: "dot", mode: "lines" },
];

function drawCharts(charts) {
  if (!window.Plotly) return;
  for (const node of document.querySelectorAll("[data-chart]")) {
    const series = charts[node.dataset.chart];
    if (!series) continue;
    const x = series.t.map(Sy.utc);
    const traces = TRACES.map((t) => ({
      name: t.name,
      type: "scatter",
      mode: t.mode,
      x,
      y: series[t.key], // null: refused (accepted) or not recorded (live): a gap
      line: { color: t.color, width: 2, dash: t.dash, shape: "hv" }, // replicas change in steps
      marker: { color: t.color, size: 5 },
    }));
    const top = Math.max(1, ...series.desired, ...series.actual.filter((v) => v !== null));
    Sy.chart(node, traces, {
      margin: { l: 34, r: 10, t: 6, b: 30 },
      xaxis: Sy.timeAxis({ tickformat: "%H:%M" }),
      yaxis: { range: [0, top + 1], dtick: top > 10 ? undefined : 1, title: { text: "replicas" } },
    });
  }
}

function deploymentIds(root) {
  return [...root.querySelectorAll("[data-deployment]")].map((n) => n.dataset.deployment).join(",");
}

function mark(ok, text) {
  const indicator = document.querySelector("[data-live]");
  if (!indicator) return;
  indicator.classList.toggle("on", ok);
  indicator.textContent = text;
}

async function refresh() {
  if (document.hidden) return; // a background tab does not poll
  let response;
  try {
    response = await fetch(location.pathname, { credentials: "same-origin", headers: { Accept: "text/html" } });
  } catch (_) {
    mark(false, "offline, retrying…");
    return;
  }
  if (!response.ok || response.redirected) {
    mark(false, response.redirected ? "signed out" : `refresh failed (HTTP ${response.status})`);
    return;
  }
  const doc = new DOMParser().parseFromString(await response.text(), "text/html");
  const fresh = doc.getElementById("fleet");
  const current = document.getElementById("fleet");
  if (!fresh || !current) return;
  if (deploymentIds(fresh) === deploymentIds(current)) {
    // Same deployments: swap the tables and facts, keep the chart nodes so Plotly redraws in place.
    for (const part of fresh.querySelectorAll("[data-refresh]")) {
      const old = current.querySelector(`[data-refresh="${CSS.escape(part.dataset.refresh)}"]`);
      if (old) old.replaceWith(document.adoptNode(part));
    }
  } else {
    current.replaceWith(document.adoptNode(fresh));
  }
  drawCharts(JSON.parse(doc.getElementById("snapshot").textContent));
  mark(true, `updated ${Sy.fmt.time(new Date())}`);
}

document.addEventListener("DOMContentLoaded", () => {
  drawCharts(Sy.snapshot() || {});
  mark(true, "live");
  setInterval(refresh, REFRESH_MS);
});
