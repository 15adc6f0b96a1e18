// Drift page: PSI over time, the reference against the current histogram of one feature, the
// latest report's table, and latency and error rate per version and arm. Everything is drawn
// from the snapshot JSON, embedded at first and fetched again every 5 s (and at once when the
// version or the feature changes), so the page never reloads.
"use strict";

const REFRESH_MS = 5000;
const PERCENTILES = [
  { key: "p99_ms", name: "p99", dash: "solid" },
  { key: "p95_ms", name: "p95", dash: "dash" },
  { key: "p50_ms", name: "p50", dash: "dot" },
];
const SCORE_COLOR = "#1c2330";
const REFERENCE_SOURCES = { upload: "uploaded", window: "a past window" };

const state = { model: "", version: null, feature: null };

// This page's charts are taller than the others' (Sy.chart).
function baseLayout(extra) {
  return { margin: { l: 48, r: 10, t: 6, b: 30 }, height: 280, legend: { orientation: "h", y: -0.18 }, ...extra };
}

const draw = Sy.chart;

function dates(values) {
  return values.map(Sy.utc); // drawn as UTC (Sy.utc)
}

function renderPsi(psi) {
  const x = dates(psi.t);
  const names = Object.keys(psi.features);
  const traces = names.map((name, i) => ({
    name,
    type: "scatter",
    mode: "lines+markers",
    marker: { size: 4 },
    line: { color: Sy.armColor(name, i), width: 1.5 },
    x,
    y: psi.features[name],
  }));
  if (psi.score.some((v) => v !== null)) {
    traces.push({
      name: "scores",
      type: "scatter",
      mode: "lines+markers",
      marker: { size: 4 },
      line: { color: SCORE_COLOR, width: 2.5 },
      x,
      y: psi.score,
    });
  }
  traces.push({
    name: "threshold",
    type: "scatter",
    mode: "lines",
    line: { color: "#c92a2a", width: 1.5, dash: "dash", shape: "hv" },
    x,
    y: psi.threshold,
    hoverinfo: "skip",
  });
  const layout = baseLayout({
    xaxis: Sy.timeAxis(),
    yaxis: { rangemode: "tozero", title: { text: "PSI" } },
  });
  draw("chart-psi", traces, layout);
}

function renderHistogram(h) {
  const select = document.getElementById("feature");
  select.replaceChildren(
    ...h.choices.map((name) => Sy.el("option", { value: name }, name === "score" ? "scores" : name))
  );
  select.value = h.feature;
  state.feature = h.feature;
  const bar = (name, y, color) => ({ name, type: "bar", x: h.bins, y, marker: { color } });
  draw(
    "chart-histogram",
    [
      bar("reference", h.reference, "#adb5bd"),
      bar("current", h.current, h.flagged ? "#e03131" : "#4c6ef5"),
    ],
    baseLayout({
      barmode: "group",
      bargap: 0.15,
      xaxis: {
        type: "category",
        title: { text: `${h.feature} · PSI ${h.psi.toFixed(3)}${h.flagged ? " · drifted" : ""}` },
      },
      yaxis: { tickformat: ".0%", rangemode: "tozero", title: { text: "share of rows" } },
      legend: { orientation: "h", x: 1, xanchor: "right", y: 1.12 }, // clear of the axis title
      margin: { l: 48, r: 10, t: 24, b: 70 },
    })
  );
}

function number(x, digits) {
  return x === null || x === undefined ? "–" : x.toFixed(digits);
}

function distance(f) {
  if (f.ks !== null && f.ks !== undefined) return `KS ${number(f.ks, 3)}`;
  if (f.distance !== null && f.distance !== undefined) return `JS ${number(f.distance, 3)}`;
  return "–";
}

function verdict(f) {
  if (f.flagged) return Sy.el("span", { class: "badge bad" }, "drifted");
  if (f.psi === null) return Sy.el("span", { class: "muted small" }, "too few values");
  return Sy.el("span", { class: "badge ok" }, "stable");
}

function count(n) {
  return Sy.el("td", { class: n ? "num warn" : "num" }, Sy.fmt.int(n));
}

function renderLatest(latest) {
  const at = Sy.fmt.time(latest.at);
  const source = REFERENCE_SOURCES[latest.reference_source] || latest.reference_source;
  const sizes = `${Sy.fmt.int(latest.rows_current)} rows against ${Sy.fmt.int(latest.rows_reference)}`;
  const drifted = latest.flagged.length ? `drifted: ${latest.flagged.join(", ")}` : "nothing drifted";
  document.querySelector('[data-field="summary"]').textContent =
    `at ${at}: ${sizes} of the reference (${source}); ${drifted}`;
  const rows = latest.features.map((f) =>
    Sy.el(
      "tr",
      { "data-feature": f.feature },
      Sy.el("td", {}, Sy.el("b", {}, f.feature === "score" ? "scores" : f.feature)),
      Sy.el("td", { class: "muted" }, f.kind),
      Sy.el("td", { class: "num" }, number(f.psi, 3)),
      Sy.el("td", { class: "num" }, distance(f)),
      Sy.el("td", { class: "num" }, f.values === null ? "–" : Sy.fmt.int(f.values)),
      count(f.nulls),
      count(f.out_of_range),
      count(f.schema),
      Sy.el("td", {}, verdict(f))
    )
  );
  document.querySelector("#features tbody").replaceChildren(...rows);
}

function renderTraffic(traffic) {
  const labels = Object.keys(traffic);
  const empty = {
    text: "No traffic in the last 3 hours.",
    showarrow: false,
    xref: "paper",
    yref: "paper",
    x: 0.5,
    y: 0.5,
  };
  const latency = [];
  labels.forEach((label, i) => {
    for (const p of PERCENTILES) {
      latency.push({
        name: `${label} ${p.name}`,
        legendgroup: label,
        type: "scatter",
        mode: "lines",
        line: { color: Sy.armColor(label.split(" · ")[1] || "", i), width: 1.8, dash: p.dash },
        x: dates(traffic[label].map((pt) => pt.t)),
        y: traffic[label].map((pt) => pt[p.key]), // null: past the last bucket (> 10 s)
      });
    }
  });
  draw(
    "chart-latency",
    latency,
    baseLayout({
      xaxis: Sy.timeAxis({ tickformat: "%H:%M" }),
      yaxis: { rangemode: "tozero", title: { text: "ms" } },
      annotations: labels.length ? [] : [empty],
    })
  );
  const errors = labels.map((label, i) => ({
    name: label,
    type: "scatter",
    mode: "lines",
    line: { color: Sy.armColor(label.split(" · ")[1] || "", i), width: 1.8 },
    x: dates(traffic[label].map((pt) => pt.t)),
    y: traffic[label].map((pt) => pt.error_rate),
  }));
  const top = Math.max(0, ...errors.flatMap((t) => t.y));
  draw(
    "chart-errors",
    errors,
    baseLayout({
      xaxis: Sy.timeAxis({ tickformat: "%H:%M" }),
      // A flat zero line would otherwise get an arbitrary axis.
      yaxis: {
        tickformat: ".1%",
        rangemode: "tozero",
        autorange: top > 0,
        range: top > 0 ? undefined : [0, 0.01],
      },
      annotations: labels.length ? [] : [empty],
    })
  );
}

function render(snapshot) {
  if (!window.Plotly) return;
  state.version = snapshot.version;
  const root = document.getElementById("drift");
  root.querySelector("[data-empty]").hidden = !snapshot.empty;
  root.querySelector("[data-empty-text]").textContent = snapshot.empty || "";
  const reports = root.querySelector("[data-reports]");
  reports.hidden = Boolean(snapshot.empty);
  if (!reports.hidden) {
    // Plotly sizes a chart from its container: draw only once the container is shown.
    if (snapshot.psi) renderPsi(snapshot.psi);
    if (snapshot.histogram) renderHistogram(snapshot.histogram);
    if (snapshot.latest) renderLatest(snapshot.latest);
  }
  renderTraffic(snapshot.traffic);
}

function dataUrl() {
  const query = new URLSearchParams();
  if (state.version !== null) query.set("version", state.version);
  if (state.feature) query.set("feature", state.feature);
  return `/models/${encodeURIComponent(state.model)}/drift/data/?${query}`;
}

document.addEventListener("DOMContentLoaded", () => {
  state.model = document.getElementById("drift").dataset.model;
  render(Sy.snapshot());
  const refresh = Sy.poll(dataUrl, render, REFRESH_MS);
  document.getElementById("version").addEventListener("change", (event) => {
    state.version = Number(event.target.value);
    state.feature = null; // another version's report: start from its most drifted feature
    history.replaceState(null, "", `?version=${state.version}`);
    refresh();
  });
  document.getElementById("feature").addEventListener("change", (event) => {
    state.feature = event.target.value;
    refresh();
  });
});
