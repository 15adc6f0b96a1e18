// Alias page: the rollback button and the review buttons post to the REST API; a refusal
// (403, 409, 400) is shown inline, a success reloads the page to show the new history row.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  const head = document.getElementById("alias");
  if (!head) return;
  const base = `/api/v1/models/${encodeURIComponent(head.dataset.model)}/aliases/${encodeURIComponent(head.dataset.alias)}`;

  const form = document.getElementById("rollback-form");
  if (form) {
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const button = form.querySelector("button[type=submit]");
      button.disabled = true;
      const result = await Sy.api("POST", `${base}/rollback`, {
        to_version: Number(form.elements.to_version.value),
        reason: form.elements.reason.value,
      });
      if (result.ok) {
        location.reload();
        return;
      }
      button.disabled = false;
      Sy.message(form.querySelector("[data-msg]"), "error", Sy.errorText(result));
    });
  }

  for (const button of document.querySelectorAll("[data-review]")) {
    button.addEventListener("click", async () => {
      button.disabled = true;
      const result = await Sy.api("POST", `${base}/history/${button.dataset.review}/review`, {});
      if (result.ok) {
        location.reload();
        return;
      }
      button.disabled = false;
      Sy.message(document.getElementById("review-msg"), "error", Sy.errorText(result));
    });
  }
});
