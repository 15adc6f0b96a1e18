// Alerts page: resolve an open alert and set the webhook, both through the REST API; the
// answer is shown inline and the nav's open count follows.
"use strict";

function lowerOpenCount() {
  const badge = document.querySelector("[data-alert-count]");
  if (!badge) return;
  const left = Number(badge.textContent) - 1;
  if (left > 0) badge.textContent = String(left);
  else badge.remove();
}

async function resolve(button) {
  const msg = document.querySelector("[data-msg]");
  button.disabled = true;
  const result = await Sy.api("POST", `/api/v1/alerts/${button.dataset.resolve}/resolve`, {
    reason: "resolved from the alerts page",
  });
  if (result.ok) {
    const row = button.closest("tr");
    row.classList.add("resolved-now");
    button.replaceWith(Sy.el("span", { class: "badge ok" }, "resolved"));
    lowerOpenCount();
    Sy.message(msg, "ok", `Resolved: ${result.data.title}.`);
  } else {
    button.disabled = false;
    Sy.message(msg, "error", Sy.errorText(result));
  }
}

async function saveWebhook() {
  const msg = document.querySelector("[data-webhook-msg]");
  const url = document.getElementById("webhook-url").value.trim();
  const result = await Sy.api("PUT", "/api/v1/alert-settings", { webhook_url: url });
  if (result.ok) {
    Sy.message(msg, "ok", result.data.webhook_url ? "Saved: new alerts are posted there." : "Saved: no webhook.");
  } else {
    Sy.message(msg, "error", Sy.errorText(result));
  }
}

document.addEventListener("DOMContentLoaded", () => {
  for (const button of document.querySelectorAll("[data-resolve]")) {
    button.addEventListener("click", () => resolve(button));
  }
  const save = document.querySelector("[data-save-webhook]");
  if (save) save.addEventListener("click", saveWebhook);
});
