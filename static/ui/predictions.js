// Prediction log page: online quality per version and arm over time, from the embedded series
// (accuracy solid and AUC dotted for classifiers, mean absolute error for regressors).
"use strict";

const COLORS = ["#4c6ef5", "#f08c00", "#12b886", "#e64980", "#7950f2", "#868e96"];
const STYLE = {
  accuracy: { dash: "solid", label: "accuracy" },
  auc: { dash: "dot", label: "AUC" },
  mae: { dash: "solid", label: "MAE" },
};

function drawQuality() {
  const node = document.getElementById("quality-chart");
  const source = document.getElementById("quality");
  if (!node || !source || !window.Plotly) return;
  const chart = JSON.parse(source.textContent);
  const traces = [];
  chart.lines.forEach((line, i) => {
    const color = COLORS[i % COLORS.length];
    for (const metric of chart.metrics) {
      traces.push({
        name: `${line.name} ${STYLE[metric].label}`,
        type: "scatter",
        mode: "lines+markers",
        x: line.t.map(Sy.utc),
        y: line[metric], // null: no labelled rows in that bucket, a gap
        text: line.labelled_rows.map((n) => `${n} labelled rows`),
        hovertemplate: "%{y:.3f} (%{text})<extra>%{fullData.name}</extra>",
        line: { color, width: 2, dash: STYLE[metric].dash },
        marker: { color, size: 5 },
      });
    }
  });
  const bounded = chart.task === "classifier"; // accuracy and AUC live in [0, 1]
  Sy.chart(node, traces, {
    margin: { l: 40, r: 10, t: 6, b: 30 },
    // The window's range, not Plotly's autorange: one bucket alone would span a millisecond.
    xaxis: Sy.timeAxis({ range: chart.range.map(Sy.utc) }),
    yaxis: bounded ? { range: [0, 1.02], title: { text: "score" } } : { rangemode: "tozero", title: { text: "MAE" } },
  });
}

document.addEventListener("DOMContentLoaded", drawQuality);
