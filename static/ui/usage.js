// Usage page: cost per day stacked by model, and requests, rows, tokens and CPU-seconds per day,
// from the series embedded in the page (monitoring.usage.chart_series).
"use strict";

const COLORS = ["#4c6ef5", "#f08c00", "#12b886", "#e64980", "#7950f2", "#868e96"];
const UNITS = [
  { field: "requests", label: "requests" },
  { field: "rows", label: "rows" },
  { field: "tokens_in", label: "tokens in" },
  { field: "tokens_out", label: "tokens out" },
  { field: "cpu_s", label: "CPU-seconds", axis: "y2" },
];

// Room on both sides: the units chart has a second axis on the right (Sy.chart). Days are
// categories: as dates, a single day's point made Plotly zoom to fractions of a millisecond.
function layout(extra) {
  return { margin: { l: 50, r: 64, t: 6, b: 30 }, xaxis: { type: "category" }, ...extra };
}

function sumOver(models, field, days) {
  return days.map((_, i) => Object.values(models).reduce((acc, m) => acc + m[field][i], 0));
}

function drawUsage() {
  const source = document.getElementById("usage-series");
  if (!source || !window.Plotly) return;
  const series = JSON.parse(source.textContent);
  const names = Object.keys(series.models);
  const cost = names.map((name, i) => ({
    name,
    type: "bar",
    x: series.days,
    y: series.models[name].cost,
    marker: { color: COLORS[i % COLORS.length] },
  }));
  Sy.chart("cost-chart", cost, layout({ barmode: "stack", yaxis: { rangemode: "tozero", title: { text: "cost" } } }));
  const units = UNITS.map((u, i) => ({
    name: u.label,
    type: "scatter",
    mode: "lines+markers",
    x: series.days,
    y: sumOver(series.models, u.field, series.days),
    yaxis: u.axis || "y",
    line: { color: COLORS[i % COLORS.length], width: 2, dash: u.axis ? "dot" : "solid" },
  }));
  Sy.chart(
    "units-chart",
    units,
    layout({
      yaxis: { rangemode: "tozero", title: { text: "count" } },
      yaxis2: { rangemode: "tozero", overlaying: "y", side: "right", title: { text: "CPU-s" } },
    })
  );
}

document.addEventListener("DOMContentLoaded", drawUsage);
