// Model page: the "start a canary" form posts to the REST API and opens the new plan; the
// "upload version" form sends the artifact to the REST API with a progress bar.
"use strict";

// fetch() cannot report upload progress; XMLHttpRequest's upload.onprogress can.
function uploadVersion(form) {
  const bar = form.querySelector("progress");
  const percent = form.querySelector("[data-percent]");
  const msg = form.querySelector("[data-msg]");
  const button = form.querySelector("button[type=submit]");
  const body = new FormData(form);
  for (const [key, value] of [...body.entries()]) {
    // An empty optional field is not sent at all; the token travels in the header.
    if (value === "" || key === "csrfmiddlewaretoken") body.delete(key);
  }
  const xhr = new XMLHttpRequest();
  xhr.open("POST", `/api/v1/models/${encodeURIComponent(form.dataset.model)}/versions`);
  xhr.setRequestHeader("Accept", "application/json");
  xhr.setRequestHeader("X-CSRFToken", Sy.csrfToken());
  xhr.setRequestHeader("X-Tenant", document.body.dataset.tenant || "");
  xhr.responseType = "json";
  const show = (fraction) => {
    bar.value = fraction;
    percent.textContent = `${Math.round(fraction * 100)} %`;
  };
  xhr.upload.onprogress = (event) => {
    if (event.lengthComputable) show(event.loaded / event.total);
  };
  xhr.upload.onload = () => {
    show(1);
    Sy.message(msg, "info", "Uploaded; the server is checking the artifact…");
  };
  xhr.onload = () => {
    button.disabled = false;
    const data = xhr.response;
    if (xhr.status === 201) {
      show(1);
      Sy.message(msg, "ok", `Uploaded as v${data.version}.`);
      // The versions table is rendered by the server: show it with the new row.
      setTimeout(() => (location.href = `${location.pathname}?uploaded=${data.version}`), 600);
    } else {
      Sy.message(msg, "error", Sy.errorText({ status: xhr.status, data }));
    }
  };
  xhr.onerror = () => {
    button.disabled = false;
    Sy.message(msg, "error", "The upload failed: the connection was lost.");
  };
  button.disabled = true;
  bar.hidden = false;
  show(0);
  Sy.message(msg, "info", "Uploading…");
  xhr.send(body);
}

document.addEventListener("DOMContentLoaded", () => {
  const upload = document.getElementById("upload-form");
  if (upload) {
    upload.addEventListener("submit", (event) => {
      event.preventDefault();
      uploadVersion(upload);
    });
  }
  // "Make INT8 variant": the server quantises and measures, then the new row is shown.
  for (const button of document.querySelectorAll("button[data-quantize]")) {
    button.addEventListener("click", async () => {
      const msg = button.parentElement.querySelector("[data-msg]");
      button.disabled = true;
      Sy.message(msg, "info", "Quantising and measuring…");
      const url = `/api/v1/models/${encodeURIComponent(button.dataset.model)}/versions/${button.dataset.quantize}/quantize`;
      const result = await Sy.api("POST", url);
      button.disabled = false;
      if (result.status === 201) {
        location.href = `${location.pathname}?uploaded=${result.data.version}`;
      } else {
        Sy.message(msg, "error", Sy.errorText(result));
      }
    });
  }
  // An approver overrides a release freeze with a reason (audited as freeze.override).
  const override = document.getElementById("freeze-override");
  if (override) {
    override.addEventListener("submit", async (event) => {
      event.preventDefault();
      const body = {
        reason: override.elements.reason.value,
        hours: Number(override.elements.hours.value),
      };
      const url = `/api/v1/models/${encodeURIComponent(override.dataset.model)}/freeze-override`;
      const result = await Sy.api("POST", url, body);
      if (result.status === 201) {
        location.reload();
      } else {
        Sy.message(override.querySelector("[data-msg]"), "error", Sy.errorText(result));
      }
    });
  }
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
