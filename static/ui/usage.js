// Usage page: cost per day stacked by model, and requests, rows, tokens and CPU-seconds per day,
// from the series embedded in the page (monitoring.usage.chart_series); and an approver's
// prices and monthly budget, set through the REST API (the same audited domain functions),
// the API's error shown next to the form.
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
  const costChart = document.getElementById("cost-chart");
  // No days: the page says "no data yet" in place of the charts (no empty axes).
  if (!source || !costChart || !window.Plotly) return;
  const series = JSON.parse(source.textContent);
  if (!series.days.length) return;
  const currency = costChart.dataset.currency;
  const names = Object.keys(series.models);
  const cost = names.map((name, i) => ({
    name,
    type: "bar",
    x: series.days,
    y: series.models[name].cost,
    marker: { color: COLORS[i % COLORS.length] },
  }));
  // Nothing priced: its zeros are no cost, so the chart says so rather than look free.
  const unpriced = costChart.dataset.pricing === "unpriced";
  const note = {
    text: "unpriced: no price set (see Prices below)",
    showarrow: false,
    xref: "paper",
    yref: "paper",
    x: 0.5,
    y: 0.5,
    font: { size: 13, color: "#868e96" },
  };
  Sy.chart(
    costChart,
    cost,
    layout({
      barmode: "stack",
      yaxis: { rangemode: "tozero", title: { text: `cost (${currency})` } },
      annotations: unpriced ? [note] : [],
    })
  );
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

// A form's answer: reload to show what is now set, else the API's error (it names the field).
async function send(form, msg, method, url, body) {
  const button = form.querySelector("button");
  button.disabled = true;
  const result = await Sy.api(method, url, body);
  button.disabled = false;
  if (result.ok) location.reload();
  else Sy.message(msg, "error", Sy.errorText(result));
}

// Only the prices changed: an empty one is sent as null (the default applies again).
function changedPrices(form) {
  const prices = {};
  for (const input of form.querySelectorAll("input[data-price]")) {
    const value = input.value.trim();
    if (value !== input.dataset.initial) prices[input.dataset.price] = value === "" ? null : value;
  }
  return prices;
}

// "50, 80, 100" as the API's list; anything else is sent as typed for the API to refuse.
function thresholds(text) {
  return text
    .split(",")
    .map((t) => t.trim())
    .filter(Boolean)
    .map((t) => (/^\d+$/.test(t) ? Number(t) : t));
}

function wireForms() {
  const prices = document.querySelector("[data-prices-form]");
  if (prices) {
    prices.addEventListener("submit", (event) => {
      event.preventDefault();
      const changed = changedPrices(prices);
      const msg = prices.querySelector("[data-prices-msg]");
      if (!Object.keys(changed).length) {
        Sy.message(msg, "info", "Nothing changed.");
        return;
      }
      send(prices, msg, "PUT", "/api/v1/usage/prices", { prices: changed });
    });
  }
  const budget = document.querySelector("[data-budget-form]");
  if (budget) {
    budget.addEventListener("submit", (event) => {
      event.preventDefault();
      const fields = budget.elements;
      send(budget, document.querySelector("[data-budget-msg]"), "PUT", "/api/v1/budget", {
        monthly_limit: fields.monthly_limit.value.trim(),
        currency: fields.currency.value.trim(),
        thresholds: thresholds(fields.thresholds.value),
        hard_stop: fields.hard_stop.checked,
      });
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  drawUsage();
  wireForms();
});
