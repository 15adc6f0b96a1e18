// Model page: the "start a canary" form posts to the REST API and opens the new plan.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("canary-form");
  if (!form) return;
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const value = (name) => form.elements[name].value;
    const body = {
      mode: "canary",
      candidate: Number(value("candidate")),
      weight: Number(value("weight")),
      steps: value("steps")
        .split(",")
        .map((s) => s.trim())
        .filter(Boolean)
        .map(Number),
      bake_seconds: Number(value("bake_seconds")),
      guardrails: {
        max_error_rate_increase: Number(value("max_error_rate_increase")),
        max_p99_ratio: Number(value("max_p99_ratio")),
        min_samples: Number(value("min_samples")),
      },
    };
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    const result = await Sy.api("POST", `/api/v1/models/${form.dataset.model}/rollouts`, body);
    button.disabled = false;
    if (result.status === 201) {
      location.href = `/rollouts/${result.data.id}/`;
    } else {
      Sy.message(form.querySelector("[data-msg]"), "error", Sy.errorText(result));
    }
  });
});
