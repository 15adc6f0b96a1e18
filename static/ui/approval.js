// Approval page: Approve / Reject post to the REST API; a refused decision (403, 409) is shown
// inline, an accepted one reloads the page to show the decision and the frozen evidence.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("decide");
  if (!form) return;
  const id = document.getElementById("approval").dataset.approvalId;
  for (const button of form.querySelectorAll("[data-decision]")) {
    button.addEventListener("click", async () => {
      const buttons = form.querySelectorAll("button");
      buttons.forEach((b) => (b.disabled = true));
      const comment = form.elements.comment.value;
      const result = await Sy.api("POST", `/api/v1/approvals/${id}/${button.dataset.decision}`, {
        comment,
      });
      if (result.ok) {
        location.reload();
        return;
      }
      buttons.forEach((b) => (b.disabled = false));
      Sy.message(form.querySelector("[data-msg]"), "error", Sy.errorText(result));
    });
  }
});
