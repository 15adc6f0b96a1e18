// Batch job page: the progress bar, rows, rate, ETA and deadline verdict, refreshed from
// /jobs/<id>/status/ every 2 s until the job ends (then once more, to show the download).
"use strict";

const JOB_REFRESH_MS = 2000;
const ENDED = ["succeeded", "failed", "cancelled"];

function verdict(onTime) {
  if (onTime === true) return "will make it";
  if (onTime === false) return "will not make it";
  return "not known yet";
}

async function refreshJob(box) {
  const response = await fetch(box.dataset.statusUrl, { credentials: "same-origin" });
  if (!response.ok) return true;
  const s = await response.json();
  const set = (sel, text) => {
    const el = box.querySelector(sel);
    if (el) el.textContent = text;
  };
  box.querySelector("[data-progress]").value = s.percent;
  set("[data-percent]", `${s.percent} %`);
  const state = box.querySelector("[data-state]");
  state.textContent = s.state;
  state.className = `badge ${s.state}`;
  set("[data-reason]", s.pause_reason || s.error || "");
  set("[data-rows-done]", s.rows_done);
  set("[data-rows-failed]", s.rows_failed);
  set("[data-rate]", s.rows_per_s ? `${s.rows_per_s} rows/s` : "–");
  set("[data-eta]", s.eta_s === null ? "–" : `${s.eta_s} s`);
  set("[data-on-time]", verdict(s.on_time));
  box.querySelector("[data-output]").hidden = s.state !== "succeeded";
  for (const form of box.querySelectorAll("[data-when]")) {
    form.hidden = !form.dataset.when.split(" ").includes(s.state);
  }
  return !ENDED.includes(s.state);
}

document.addEventListener("DOMContentLoaded", () => {
  const box = document.getElementById("job-status");
  if (!box) return;
  const tick = async () => {
    let going = true;
    try {
      going = await refreshJob(box);
    } catch (e) {
      going = true; // a network blip: try again at the next tick
    }
    if (going) setTimeout(tick, JOB_REFRESH_MS);
  };
  setTimeout(tick, JOB_REFRESH_MS);
});
