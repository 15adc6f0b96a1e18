// Dashboard: fills each model's split and numbers from the embedded snapshot, then keeps them
// live from the socket.
"use strict";

function renderDashboard(snapshot) {
  for (const model of snapshot.models) {
    const row = document.querySelector(`tr[data-model="${CSS.escape(model.name)}"]`);
    if (!row) continue; // a model created since the page loaded shows on the next visit
    for (const alias of model.aliases) {
      const line = row.querySelector(`[data-alias="${CSS.escape(alias.name)}"] [data-split]`);
      if (line) Sy.renderSplit(line, alias.split);
    }
    const s = model.summary;
    row.querySelector('[data-field="rps"]').textContent = Sy.fmt.rps(s.rps);
    row.querySelector('[data-field="error_rate"]').textContent = s.requests
      ? Sy.fmt.pct(s.error_rate)
      : "–";
    row.querySelector('[data-field="p99_ms"]').textContent = s.requests ? Sy.fmt.ms(s.p99_ms) : "–";
  }
  const body = document.querySelector("#agents tbody");
  const rows = snapshot.agents.map((a) =>
    Sy.el(
      "tr",
      {},
      Sy.el("td", {}, a.node),
      Sy.el("td", {}, a.ready.length ? a.ready.join(", ") : "none ready"),
      Sy.el("td", { class: "num" }, String(a.queue_depth)),
      Sy.el("td", { class: "num" }, String(a.in_flight)),
      Sy.el("td", { class: "num" }, a.p99_ms ? `${a.p99_ms.toFixed(1)} ms` : "–")
    )
  );
  if (!rows.length) {
    rows.push(Sy.el("tr", {}, Sy.el("td", { colspan: "5", class: "empty" }, "No agent connected.")));
  }
  body.replaceChildren(...rows);
}

document.addEventListener("DOMContentLoaded", () => {
  renderDashboard(Sy.snapshot());
  Sy.live({ subscribe: "dashboard" }, renderDashboard);
});
