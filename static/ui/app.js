// Switchyard UI helpers shared by every page: REST calls with the session's CSRF token and
// tenant, the live socket, number formatting and the traffic split bar.
"use strict";

const Sy = (() => {
  const ARM_COLORS = { baseline: "#4c6ef5", candidate: "#f08c00", shadow: "#ae3ec9", all: "#4c6ef5" };
  const PALETTE = ["#4c6ef5", "#f08c00", "#12b886", "#e64980", "#7950f2", "#fab005"];

  function armColor(name, index) {
    return ARM_COLORS[name] || PALETTE[index % PALETTE.length];
  }

  function cookie(name) {
    const found = document.cookie.split("; ").find((c) => c.startsWith(name + "="));
    return found ? decodeURIComponent(found.split("=")[1]) : "";
  }

  // The page's CSRF token: the form's hidden field (always there), else the cookie.
  function csrfToken() {
    const field = document.querySelector("input[name=csrfmiddlewaretoken]");
    return field ? field.value : cookie("csrftoken");
  }

  // Every change goes through the REST API; it answers JSON, errors as {"error": "..."}.
  async function api(method, url, body) {
    const response = await fetch(url, {
      method,
      credentials: "same-origin",
      headers: {
        "Content-Type": "application/json",
        Accept: "application/json",
        "X-CSRFToken": csrfToken(),
        "X-Tenant": document.body.dataset.tenant || "",
      },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    let data = null;
    try {
      data = await response.json();
    } catch (_) {
      data = null;
    }
    return { status: response.status, ok: response.ok, data };
  }

  function errorText(result) {
    return (result.data && result.data.error) || `request failed (HTTP ${result.status})`;
  }

  // One subscription per socket; reconnects with backoff unless the server says "not found".
  function live(subscription, onUpdate) {
    const indicator = document.querySelector("[data-live]");
    let delay = 1000;
    function mark(on) {
      if (!indicator) return;
      indicator.classList.toggle("on", on);
      indicator.textContent = on ? "live" : "reconnecting…";
    }
    function open() {
      const scheme = location.protocol === "https:" ? "wss" : "ws";
      const socket = new WebSocket(`${scheme}://${location.host}/ws/ui/live/`);
      socket.onopen = () => {
        delay = 1000;
        socket.send(JSON.stringify(subscription));
        mark(true);
      };
      socket.onmessage = (event) => onUpdate(JSON.parse(event.data));
      socket.onclose = (event) => {
        mark(false);
        if (event.code >= 4400 && event.code < 4500) {
          if (indicator) indicator.textContent = "not available";
          return;
        }
        setTimeout(open, delay);
        delay = Math.min(delay * 2, 15000);
      };
    }
    open();
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "style") Object.assign(node.style, value);
      else if (key === "class") node.className = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child);
    }
    return node;
  }

  // One time-zone convention: every time the UI shows is UTC, labelled. Plotly draws a Date in
  // the browser's zone, so charts get UTC wall-clock strings ("2026-11-26 14:03:07.000"),
  // which it draws as they are.
  function utc(t) {
    const d = t instanceof Date ? t : new Date(t);
    return d.toISOString().replace("T", " ").replace("Z", "");
  }

  // A chart's time axis, labelled with its zone.
  function timeAxis(extra) {
    return { type: "date", title: { text: "time (UTC)", standoff: 4 }, ...extra };
  }

  // Every page's charts share one look: a 230 px box (the .chart class), the legend below,
  // the page's font, no background and no mode bar. ``layout`` adds to or overrides it.
  //
  // Two promises hold for every chart here: a line never bridges a gap in the data (a point
  // missing for longer than the series' usual step gets a break), and a chart with no data
  // says "no data yet" instead of drawing empty axes.
  function chart(node, traces, layout) {
    traces = traces.map(breakGaps);
    const empty = traces.every((t) => !(t.y || []).some((v) => v !== null && v !== undefined));
    if (empty) {
      layout = {
        ...layout,
        annotations: [
          { text: "no data yet", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: { size: 14, color: "#868e96" } },
        ],
      };
    }
    const base = {
      margin: { l: 44, r: 10, t: 6, b: 30 },
      height: 230,
      showlegend: true,
      legend: { orientation: "h", y: -0.2 },
      font: { family: "system-ui, sans-serif", size: 11 },
      paper_bgcolor: "rgba(0,0,0,0)",
      plot_bgcolor: "rgba(0,0,0,0)",
    };
    window.Plotly.react(node, traces, { ...base, ...layout }, { displayModeBar: false, responsive: true });
  }

  // A line trace over time with a null inserted wherever consecutive points lie more than
  // 2.5 typical steps apart, and connectgaps off: Plotly then breaks the line there.
  function breakGaps(trace) {
    const lines = (trace.mode || "lines").includes("lines") && (trace.type || "scatter") === "scatter";
    const x = trace.x || [];
    if (!lines || x.length < 3 || !trace.y) return { connectgaps: false, ...trace };
    const times = x.map((t) => new Date(t).getTime());
    if (times.some(Number.isNaN)) return { connectgaps: false, ...trace };
    const steps = times.slice(1).map((t, i) => t - times[i]).filter((d) => d > 0).sort((a, b) => a - b);
    const step = steps[Math.floor(steps.length / 2)];
    if (!step) return { connectgaps: false, ...trace };
    // Arrays that run along the points (hover text) get the break too, to stay aligned.
    const along = ["y", "text", "hovertext", "customdata"].filter(
      (k) => Array.isArray(trace[k]) && trace[k].length === x.length
    );
    const out = { ...trace, x: [x[0]], connectgaps: false };
    for (const k of along) out[k] = [trace[k][0]];
    for (let i = 1; i < x.length; i++) {
      if (times[i] - times[i - 1] > 2.5 * step) {
        out.x.push(x[i - 1]); // a null at the last point's time: the line stops there
        for (const k of along) out[k].push(null);
      }
      out.x.push(x[i]);
      for (const k of along) out[k].push(trace[k][i]);
    }
    return out;
  }

  const fmt = {
    time: (t) => `${utc(t).slice(11, 19)} UTC`,
    pct: (x) => (x === null || x === undefined ? "–" : `${(x * 100).toFixed(2)} %`),
    ms: (x) => (x === null || x === undefined ? "> 10 s" : `${x} ms`),
    rps: (x) => `${Number(x).toFixed(x >= 10 ? 0 : 2)}/s`,
    weight: (x) => `${Number(x.toFixed(1))} %`,
    int: (x) => Number(x).toLocaleString(),
  };

  // A split is [{arm, version, weight}]: one coloured segment per arm and a legend.
  function renderSplit(container, split) {
    const bar = container.querySelector(".split");
    const legend = container.querySelector(".legend");
    bar.replaceChildren(
      ...split
        .filter((a) => a.weight > 0)
        .map((a, i) =>
          el(
            "div",
            {
              class: "seg",
              title: `${a.arm} v${a.version}: ${fmt.weight(a.weight)}`,
              style: { width: `${a.weight}%`, background: armColor(a.arm, i) },
            },
            a.weight >= 15 ? fmt.weight(a.weight) : ""
          )
        )
    );
    if (legend) {
      legend.replaceChildren(
        ...split.map((a, i) =>
          el(
            "span",
            { "data-arm": a.arm },
            el("span", { class: "dot", style: { background: armColor(a.arm, i) } }),
            `${a.arm === "all" ? "" : a.arm + " "}v${a.version} · ${fmt.weight(a.weight)}`
          )
        )
      );
    }
  }

  function message(node, kind, ...content) {
    node.className = `msg ${kind}`;
    node.replaceChildren(...content);
  }

  function snapshot() {
    const node = document.getElementById("snapshot");
    return node ? JSON.parse(node.textContent) : null;
  }

  document.addEventListener("DOMContentLoaded", () => {
    for (const select of document.querySelectorAll("select[data-autosubmit]")) {
      select.addEventListener("change", () => select.form.submit());
    }
  });

  // A page's JSON snapshot polled every `everyMs` (skipped while the tab is hidden), rendered by
  // `onData`; the [data-live] indicator says how it goes. `refresh` polls now (filters changed).
  function poll(url, onData, everyMs = 5000) {
    const indicator = document.querySelector("[data-live]");
    function mark(ok, text) {
      if (!indicator) return;
      indicator.classList.toggle("on", ok);
      indicator.textContent = text;
    }
    async function refresh() {
      let response;
      try {
        response = await fetch(url(), {
          credentials: "same-origin",
          headers: { Accept: "application/json" },
        });
      } catch (_) {
        mark(false, "offline, retrying…");
        return;
      }
      if (!response.ok || response.redirected) {
        mark(false, response.redirected ? "signed out" : `refresh failed (HTTP ${response.status})`);
        return;
      }
      onData(await response.json());
      mark(true, `updated ${fmt.time(new Date())}`);
    }
    mark(true, "live");
    setInterval(() => {
      if (!document.hidden) refresh();
    }, everyMs);
    return refresh;
  }

  return { api, csrfToken, utc, timeAxis, chart, errorText, live, poll, el, fmt, renderSplit, armColor, message, snapshot };
})();
