// SLO page: per model, both SLIs with their error budget bar and burn rates, and a chart of the
// 1 h and 5 m burn rates against the alert thresholds; refreshed from /slo/data/ every 5 s.
"use strict";

const REFRESH_MS = 5000;
// The multi-window rules (monitoring/slo.py ALERT_RULES): both windows past the rate.
const RULES = [
  { windows: ["1h", "5m"], rate: 14.4, name: "critical" },
  { windows: ["6h", "30m"], rate: 6, name: "warning" },
];
const SLI_COLORS = { availability: "#4c6ef5", latency: "#f08c00" };

function pct(x, digits) {
  return `${Number((x * 100).toFixed(digits))} %`;
}

function objectiveText(s) {
  return s.sli === "availability"
    ? `${pct(s.objective, 3)} of requests without a server error`
    : `${pct(s.objective, 3)} of requests within ${s.threshold_ms} ms`;
}

function budgetBar(remaining) {
  const shown = Math.max(0, Math.min(1, remaining));
  const kind = remaining <= 0 ? "spent" : remaining < 0.5 ? "low" : "";
  return Sy.el(
    "div",
    { class: `budget ${kind}`, title: "error budget left over the window" },
    Sy.el("div", { class: "bar" }, Sy.el("div", { class: "fill", style: { width: `${shown * 100}%` } })),
    Sy.el("span", { class: "value" }, pct(remaining, 1))
  );
}

function hotWindows(burn) {
  const hot = new Set();
  for (const rule of RULES) {
    for (const w of rule.windows) if (burn[w] > rule.rate) hot.add(w);
  }
  return hot;
}

function renderRow(row, s) {
  row.querySelector('[data-field="objective"]').textContent = objectiveText(s);
  const value = row.querySelector('[data-field="value"]'); // not in the overview
  if (value) value.textContent = s.value === null ? "no traffic" : `${pct(s.value, 3)} of ${Sy.fmt.int(s.requests)}`;
  // Too few requests say nothing about a budget (monitoring/slo.py min_events): no bar, no alert.
  row.querySelector('[data-field="budget"]').replaceChildren(
    s.enough_data
      ? budgetBar(s.budget_remaining)
      : Sy.el(
          "span",
          { class: "muted small", "data-not-enough": "" },
          `not enough data: n = ${Sy.fmt.int(s.requests)} (alerts and freezes need ${Sy.fmt.int(s.min_events)})`
        )
  );
  renderBurn(row, s);
}

function renderBurn(row, s) {
  const hot = hotWindows(s.burn);
  for (const cell of row.querySelectorAll("[data-burn]")) {
    const w = cell.dataset.burn;
    cell.textContent = `${s.burn[w].toFixed(s.burn[w] >= 10 ? 1 : 2)}×`;
    cell.classList.toggle("hot", hot.has(w));
  }
  row.querySelector('[data-field="alert"]').replaceChildren(
    s.alert
      ? Sy.el("span", { class: `badge ${s.alert}` }, s.alert)
      : Sy.el("span", { class: "muted small" }, "none")
  );
}

// The overview: one row per model and SLI, the same cells as the model's own table.
function renderOverview(snapshot) {
  for (const model of snapshot.models) {
    for (const s of model.slis) {
      const row = document.querySelector(
        `tr[data-overview="${CSS.escape(model.model)}"][data-sli="${s.sli}"]`
      );
      if (row) renderRow(row, s);
    }
  }
}

function renderChart(node, model) {
  const series = model.series;
  const x = series.t.map(Sy.utc);
  const traces = [];
  for (const sli of ["availability", "latency"]) {
    traces.push(
      { name: `${sli} · 1 h`, x, y: series[`${sli}_1h`], line: { color: SLI_COLORS[sli], width: 2 } },
      {
        name: `${sli} · 5 m`,
        x,
        y: series[`${sli}_5m`],
        line: { color: SLI_COLORS[sli], width: 1, dash: "dot" },
      }
    );
  }
  for (const t of traces) Object.assign(t, { type: "scatter", mode: "lines", connectgaps: false });
  const values = traces.flatMap((t) => t.y).filter((v) => v !== null);
  const top = Math.max(16, ...values) * 1.1; // the critical line always in view
  const threshold = (rate, color, text) => ({
    type: "line",
    xref: "paper",
    x0: 0,
    x1: 1,
    y0: rate,
    y1: rate,
    line: { color, width: 1, dash: "dash" },
    label: { text, textposition: "end", font: { size: 10, color } },
  });
  Sy.chart(node, traces, {
    height: 280,
    legend: { orientation: "h", y: -0.18 },
    xaxis: Sy.timeAxis({ tickformat: "%H:%M" }),
    yaxis: { range: [0, top], title: { text: "burn rate (×)" } },
    shapes: [
      threshold(14.4, "#c92a2a", "critical 14.4×"),
      threshold(6, "#e8590c", "warning 6×"),
      threshold(1, "#adb5bd", "1×"),
    ],
  });
}

function render(snapshot) {
  renderOverview(snapshot);
  for (const model of snapshot.models) {
    const section = document.querySelector(`section[data-model="${CSS.escape(model.model)}"]`);
    if (!section) continue; // a model created since the page loaded shows on the next visit
    for (const s of model.slis) {
      const row = section.querySelector(`tr[data-sli="${s.sli}"]`);
      if (row) renderRow(row, s);
    }
    section.querySelector('[data-field="not-ready"]').textContent = model.not_ready
      ? `${Sy.fmt.int(model.not_ready)} requests were refused while no replica was ready yet ` +
        "(503 with Retry-After): not counted in the SLIs."
      : "";
    if (window.Plotly) renderChart(section.querySelector("[data-chart]"), model);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  render(Sy.snapshot());
  Sy.poll(() => "/slo/data/", render, REFRESH_MS);
});
