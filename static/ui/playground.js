// The playground: one generation at a time over /ws/v1/models/{name}/generate, signed in with
// the session. Tokens are appended as they arrive; the done frame brings TTFT and tokens/s.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("playground");
  if (!form) return;
  const $ = (selector) => document.querySelector(selector);
  const output = $("[data-output]");
  const msg = form.querySelector("[data-msg]");
  const run = form.querySelector("[data-run]");
  const stop = form.querySelector("[data-stop]");
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  let socket = null;
  let started = 0;
  let firstAt = null;
  let count = 0;

  function busy(on) {
    run.disabled = on;
    stop.disabled = !on;
  }

  function connect() {
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(`${scheme}://${location.host}/ws/v1/models/${form.dataset.model}/generate`);
      ws.onopen = () => resolve(ws);
      ws.onerror = () => reject(new Error("could not open the generation socket"));
      ws.onclose = () => { socket = null; busy(false); };
      ws.onmessage = (event) => receive(JSON.parse(event.data));
    });
  }

  function receive(frame) {
    if (frame.type === "token") {
      if (firstAt === null) {
        firstAt = performance.now();
        $("[data-ttft]").textContent = `${(firstAt - started).toFixed(0)} ms (in the browser)`;
      }
      count += frame.tokens;
      output.append(frame.text);
      $("[data-tokens]").textContent = count;
    } else if (frame.type === "done") {
      busy(false);
      $("[data-finish]").textContent = frame.finish_reason;
      if (frame.usage) {
        const u = frame.usage;
        $("[data-ttft]").textContent = `${u.ttft_ms} ms`;
        $("[data-tps]").textContent = `${u.tokens_per_second}`;
        $("[data-tokens]").textContent = `${u.input_tokens} in, ${u.output_tokens} out`;
        $("[data-served]").textContent = `v${frame.version}${frame.arm ? ` (${frame.arm})` : ""}`;
      }
    } else if (frame.type === "error") {
      busy(false);
      Sy.message(msg, "error", `${frame.code}: ${frame.message}`);
    }
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    Sy.message(msg, "");
    output.textContent = "";
    for (const key of ["ttft", "tps", "tokens", "finish", "served"]) $(`[data-${key}]`).textContent = "–";
    const data = new FormData(form);
    const stopText = data.get("stop").replace(/\\n/g, "\n");
    const request = {
      type: "generate",
      id: `p${Date.now()}`,
      prompt: data.get("prompt"),
      max_tokens: Number(data.get("max_tokens")),
      temperature: Number(data.get("temperature")),
      top_p: Number(data.get("top_p")),
      stop: stopText ? [stopText] : [],
    };
    if (data.get("seed") !== "") request.seed = Number(data.get("seed"));
    try {
      socket = socket || (await connect());
    } catch (error) {
      Sy.message(msg, "error", error.message);
      return;
    }
    busy(true);
    started = performance.now();
    firstAt = null;
    count = 0;
    form.dataset.current = request.id;
    socket.send(JSON.stringify(request));
  });

  stop.addEventListener("click", () => {
    if (socket) socket.send(JSON.stringify({ type: "cancel", id: form.dataset.current }));
  });
});
