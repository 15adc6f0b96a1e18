// Rollout page: the canary's step timeline with its bake countdown, the weight slider (which
// only changes the value shown: "Apply weight" sends it), plan controls, per-arm table and
// Plotly charts, all kept live from the socket; changes go to the REST API and its answer is
// shown inline.
"use strict";

const CHARTS = ["rps", "error_rate", "p99_ms"];
const STATE_LABELS = { running: "Running", paused: "Paused", promoted: "Promoted", rolled_back: "Rolled back" };

const page = {
  root: null,
  planId: 0,
  weight: 0,
  busy: false, // a change is in flight: live updates must not move the slider under the user
  chosen: null, // a weight picked on the slider and not applied yet: live updates keep it
  bakeEndsAt: null, // the current step's bake end, on this browser's clock
};

const STEP_LABELS = {
  done: "done",
  current: "current",
  upcoming: "upcoming",
  approval: "needs approval",
  killed: "killed here",
  skipped: "skipped",
  not_reached: "not reached",
};
const END_LABELS = {
  promoted: "promoted",
  rolled_back: "rolled back",
  approval: "promotion needs approval",
  upcoming: "promotion",
};

function $(selector) {
  return page.root.querySelector(selector);
}

function showWeight(weight) {
  const out = document.getElementById("weight-out");
  if (out) out.textContent = Sy.fmt.weight(weight);
}

function canarySplit(snapshot, weight) {
  const [baseline, candidate] = snapshot.split;
  return [
    { ...baseline, weight: 100 - weight },
    { ...candidate, weight },
  ];
}

function renderArms(arms) {
  const rows = arms.map((a, i) =>
    Sy.el(
      "tr",
      { "data-arm": a.arm },
      Sy.el(
        "td",
        {},
        Sy.el("span", { class: "dot", style: { background: Sy.armColor(a.arm, i) } }),
        " ",
        a.arm
      ),
      Sy.el("td", {}, `v${a.version}`),
      Sy.el("td", { class: "num" }, a.arm === "shadow" ? "copy" : Sy.fmt.weight(a.weight)),
      Sy.el("td", { class: "num", "data-field": "requests" }, Sy.fmt.int(a.requests)),
      Sy.el("td", { class: "num" }, Sy.fmt.int(a.errors)),
      Sy.el("td", { class: "num" }, a.requests ? Sy.fmt.pct(a.error_rate) : "–"),
      Sy.el("td", { class: "num" }, a.requests ? Sy.fmt.ms(a.p50_ms) : "–"),
      Sy.el("td", { class: "num" }, a.requests ? Sy.fmt.ms(a.p95_ms) : "–"),
      Sy.el("td", { class: "num" }, a.requests ? Sy.fmt.ms(a.p99_ms) : "–")
    )
  );
  document.querySelector("#arms tbody").replaceChildren(...rows);
}

const STEP_MS = 10_000; // the series' resolution (monitoring.traffic.timeseries step_s)
const REQUEST_STATES = { pending: "Pending", approved: "Approved", applied: "Applied", rejected: "Rejected", cancelled: "Cancelled" };

// Only slots with traffic come back: a gap in requests/s is zero traffic, so draw it as zero;
// error rate and p99 have no value without requests and stay gaps.
function withZeros(points) {
  const out = [];
  for (const p of points) {
    const t = new Date(p.t).getTime();
    const prev = out.length ? out[out.length - 1].x : null;
    if (prev !== null && t - prev > 1.5 * STEP_MS) {
      out.push({ x: prev + STEP_MS, y: 0 });
      if (t - STEP_MS > prev + STEP_MS) out.push({ x: t - STEP_MS, y: 0 });
    }
    out.push({ x: t, y: p.rps });
  }
  return out;
}

function renderCharts(snapshot) {
  if (!window.Plotly) return;
  const series = snapshot.series;
  const now = Date.now();
  const times = Object.values(series).flat().map((p) => new Date(p.t).getTime());
  // At least the last 5 minutes, at most the 15 the series covers.
  const start = Math.min(now - 5 * 60_000, ...times);
  const stepStart = Sy.utc(snapshot.step_started_at);
  for (const field of CHARTS) {
    const traces = Object.keys(series).map((name, i) => {
      const points =
        field === "rps"
          ? withZeros(series[name])
          : series[name].map((p) => ({ x: new Date(p.t).getTime(), y: p[field] }));
      return {
        name,
        type: "scatter",
        mode: "lines+markers",
        marker: { size: 4 },
        line: { color: Sy.armColor(name, i), width: 2 },
        x: points.map((p) => Sy.utc(p.x)),
        y: points.map((p) => p.y),
      };
    });
    const values = traces.flatMap((t) => t.y).filter((v) => v !== null);
    const top = Math.max(0, ...values);
    Sy.chart(`chart-${field}`, traces, {
      xaxis: Sy.timeAxis({ tickformat: "%H:%M", range: [Sy.utc(start), Sy.utc(now + STEP_MS)] }),
      yaxis: {
        rangemode: "tozero",
        tickformat: field === "error_rate" ? ".1%" : "",
        // A flat zero line would otherwise get an arbitrary axis (an error rate of 0 to 50 %).
        autorange: top > 0,
        range: top > 0 ? undefined : [0, field === "error_rate" ? 0.01 : 1],
      },
      // Where the current step (the one the guardrails judge) began.
      shapes: [
        {
          type: "line",
          xref: "x",
          yref: "paper",
          x0: stepStart,
          x1: stepStart,
          y0: 0,
          y1: 1,
          line: { color: "#adb5bd", width: 1, dash: "dot" },
        },
      ],
    });
  }
}

// What each kind of approval request asks for (rollouts.models.RequestKind).
const REQUEST_KINDS = {
  promotion: ["Promotion", (r) => `→ v${r.to_version}`],
  weight: ["Weight change", (r) => `weight → ${Sy.fmt.weight(r.weight)}`],
  arms: [
    "A/B arm weights",
    (r) =>
      Object.entries(r.arm_weights || {})
        .map(([arm, w]) => `${arm} → ${Sy.fmt.weight(w)}`)
        .join(", "),
  ],
};

function renderRequests(requests) {
  const rows = requests.map((r) =>
    Sy.el(
      "tr",
      { "data-request": String(r.id) },
      Sy.el("td", {}, Sy.el("a", { href: `/approvals/${r.id}/` }, `#${r.id}`)),
      Sy.el("td", {}, (REQUEST_KINDS[r.kind] || [r.kind])[0]),
      Sy.el("td", {}, REQUEST_KINDS[r.kind] ? REQUEST_KINDS[r.kind][1](r) : ""),
      Sy.el("td", {}, Sy.el("span", { class: `badge ${r.state}` }, REQUEST_STATES[r.state] || r.state)),
      Sy.el("td", {}, r.requested_by)
    )
  );
  if (!rows.length) {
    rows.push(Sy.el("tr", {}, Sy.el("td", { colspan: "5", class: "empty" }, "None for this plan.")));
  }
  document.querySelector("#requests tbody").replaceChildren(...rows);
}

function renderState(state, active) {
  for (const badge of page.root.querySelectorAll("[data-state]")) {
    badge.className = `badge ${state}`;
    badge.textContent = STATE_LABELS[state] || state;
  }
  const pause = $('[data-action="pause"]');
  const resume = $('[data-action="resume"]');
  if (pause) pause.hidden = state !== "running";
  if (resume) resume.hidden = state !== "paused";
  for (const action of ["kill", "promotion"]) {
    const button = $(`[data-action="${action}"]`);
    if (button) button.disabled = !active;
  }
  const slider = document.getElementById("weight");
  if (slider) slider.disabled = !active || page.root.dataset.canWrite !== "1";
  const apply = document.getElementById("apply-weight");
  if (apply) apply.disabled = !active;
}

// The weight the Apply button would send, and whether it differs from the plan's.
function showChosen(weight) {
  const value = document.querySelector("[data-apply-value]");
  if (value) value.textContent = Sy.fmt.weight(weight);
  const pending = weight !== page.weight;
  const reset = document.getElementById("reset-weight");
  if (reset) reset.hidden = !pending;
  const note = document.querySelector("[data-pending-weight]");
  if (note) note.hidden = !pending;
}

function renderWeight(weight) {
  page.weight = weight;
  const slider = document.getElementById("weight");
  if (slider && !page.busy && page.chosen === null) {
    slider.value = String(Math.round(weight));
    showWeight(weight);
    showChosen(weight);
  }
  for (const step of page.root.querySelectorAll("[data-step]")) {
    step.classList.toggle("current", Number(step.dataset.step) === weight);
  }
}

function pill(text, state, extra) {
  return Sy.el("li", { class: `pill ${state}`, "data-state": state, ...extra }, text);
}

function renderTimeline(timeline, note) {
  const list = document.querySelector("[data-timeline]");
  if (!list || !timeline) return;
  const pills = timeline.steps.map((s) =>
    pill(
      Sy.el(
        "span",
        {},
        Sy.el("b", {}, Sy.fmt.weight(s.weight)),
        Sy.el("small", {}, STEP_LABELS[s.state] + (s.gated && s.state === "upcoming" ? " · approval" : ""))
      ),
      s.state,
      { "data-step-weight": String(s.weight), title: s.gated ? "above the plan's bound: an approver must agree" : "" }
    )
  );
  pills.push(
    pill(Sy.el("span", {}, Sy.el("b", {}, "end"), Sy.el("small", {}, END_LABELS[timeline.end])), `end ${timeline.end}`, {
      "data-end": timeline.end,
    })
  );
  list.replaceChildren(...pills);
  // The server's clock decides when the bake ends; the offset carries it to this browser's.
  page.bakeEndsAt = timeline.bake_ends_at
    ? new Date(timeline.bake_ends_at).getTime() - (new Date(timeline.now).getTime() - Date.now())
    : null;
  document.querySelector("[data-timeline-note]").textContent = note || "";
  tick();
}

function clock(seconds) {
  const h = Math.floor(seconds / 3600);
  const m = Math.floor((seconds % 3600) / 60);
  const s = String(seconds % 60).padStart(2, "0");
  return h ? `${h}:${String(m).padStart(2, "0")}:${s}` : `${m}:${s}`;
}

// Once a second: how much longer the current step bakes before the guardrails may advance it.
function tick() {
  const node = document.querySelector("[data-countdown]");
  if (!node) return;
  if (page.bakeEndsAt === null) {
    node.textContent = "";
    return;
  }
  const left = Math.ceil((page.bakeEndsAt - Date.now()) / 1000);
  node.textContent = left > 0 ? `bakes ${clock(left)} more` : "baked: the guardrails judge the step";
  node.className = left > 0 ? "countdown" : "countdown done";
}

function render(snapshot) {
  renderState(snapshot.state, snapshot.active);
  renderTimeline(snapshot.timeline, snapshot.status_note);
  if (page.busy) {
    // Keep the split the user just set until the API has answered.
  } else if (page.root.dataset.mode === "canary") {
    Sy.renderSplit($("[data-split]"), canarySplit(snapshot, snapshot.weight));
  } else {
    Sy.renderSplit($("[data-split]"), snapshot.split);
  }
  renderWeight(snapshot.weight);
  $("[data-status-note]").textContent = snapshot.status_note || "–";
  renderArms(snapshot.arms);
  renderCharts(snapshot);
  renderRequests(snapshot.requests);
  const shadow = $("[data-shadow]");
  if (shadow && snapshot.shadow) {
    const s = snapshot.shadow;
    shadow.textContent =
      s.agreement_rate === null
        ? "no copies compared yet"
        : `${(s.agreement_rate * 100).toFixed(1)} % of ${Sy.fmt.int(s.answered)} copies agreed (${s.failed} failed)`;
  }
  page.last = snapshot;
}

function approvalLink(approval, text) {
  return Sy.el("a", { href: `/approvals/${approval.id}/` }, text || `request #${approval.id}`);
}

async function post(path, body) {
  page.busy = true;
  try {
    return await Sy.api("POST", `/api/v1/rollouts/${page.planId}/${path}`, body);
  } finally {
    page.busy = false;
  }
}

async function setWeight(weight) {
  const msg = $("[data-msg]");
  const reason = (document.getElementById("reason") || {}).value || "";
  const result = await post("weight", { weight, reason });
  page.chosen = null; // applied, sent for approval or refused: the plan's weight shows again
  if (result.status === 200) {
    renderWeight(result.data.weight);
    Sy.renderSplit($("[data-split]"), canarySplit(page.last, result.data.weight));
    Sy.message(msg, "ok", `Applied: the candidate now gets ${Sy.fmt.weight(result.data.weight)} of traffic.`);
  } else if (result.status === 202) {
    renderWeight(page.weight); // unchanged until an approver agrees
    Sy.message(
      msg,
      "info",
      `${Sy.fmt.weight(weight)} is above ${Sy.fmt.weight(Number(page.root.dataset.maxWeight))}: sent for approval as `,
      approvalLink(result.data),
      "."
    );
  } else {
    renderWeight(page.weight);
    Sy.message(msg, "error", Sy.errorText(result));
  }
}

async function control(action) {
  const msg = $("[data-msg]");
  if (action === "kill" && !window.confirm("Send all traffic back to the baseline and end this plan?")) {
    return;
  }
  let body = {};
  if (action === "promotion") {
    body = { comment: document.getElementById("promotion-comment").value };
  } else if (action === "kill") {
    body = { reason: (document.getElementById("reason") || {}).value || "kill switch from the UI" };
  }
  const result = await post(action, body);
  if (result.status === 202 && action === "promotion") {
    Sy.message(msg, "info", "Promotion sent for approval: ", approvalLink(result.data), ".");
  } else if (result.ok) {
    renderState(result.data.state, ["running", "paused"].includes(result.data.state));
    if (result.data.weight !== undefined) renderWeight(result.data.weight);
    Sy.message(msg, "ok", `Done: the plan is ${(STATE_LABELS[result.data.state] || result.data.state).toLowerCase()}.`);
  } else {
    Sy.message(msg, "error", Sy.errorText(result));
  }
}

document.addEventListener("DOMContentLoaded", () => {
  page.root = document.getElementById("plan");
  page.planId = Number(page.root.dataset.planId);
  render(Sy.snapshot());

  const slider = document.getElementById("weight");
  if (slider) {
    // Moving the slider (mouse, touch or arrow keys) only changes the value shown; nothing
    // is sent until "Apply weight" is pressed.
    slider.addEventListener("input", () => {
      page.chosen = Number(slider.value);
      showWeight(page.chosen);
      showChosen(page.chosen);
    });
  }
  const apply = document.getElementById("apply-weight");
  if (apply && slider) {
    apply.addEventListener("click", () => setWeight(Number(slider.value)));
  }
  const reset = document.getElementById("reset-weight");
  if (reset) {
    reset.addEventListener("click", () => {
      page.chosen = null;
      renderWeight(page.weight);
    });
  }
  setInterval(tick, 1000);
  for (const button of page.root.querySelectorAll("[data-action]")) {
    button.addEventListener("click", () => control(button.dataset.action));
  }
  Sy.live({ subscribe: "plan", id: page.planId }, render);
});
