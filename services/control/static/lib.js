// xtoken control plane dashboard: helpers shared by app.js (one run) and compare.js (runs side
// by side): DOM building (text only), number formats, the API client, chart sizes.
//
// Every value that comes from the server (run names, configs, reasons, log lines) reaches the
// page as text (textContent, dataset, title), never parsed as markup. The bearer token lives in
// sessionStorage (this tab only) and travels only in the Authorization header of mutating calls.
(function () {
  "use strict";

  const TOKEN_KEY = "xtoken.controlToken";
  // whole steps on the x axes
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];
  const CHART_HEIGHT = 200;

  const $ = (id) => document.getElementById(id);

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") node.className = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else if (k === "title") node.title = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) {
      if (c === undefined || c === null) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function setText(id, value) {
    $(id).textContent = value === undefined || value === null || value === "" ? "-" : String(value);
  }

  function stateBadge(state) {
    const s = String(state || "?");
    const cls = /^[A-Z]+$/.test(s) ? "state state-" + s : "state";
    return el("span", { class: cls, dataset: { state: s } }, s);
  }

  function fmt(x, digits) {
    if (x === undefined || x === null || Number.isNaN(x)) return "-";
    const n = Number(x);
    if (!Number.isFinite(n)) return String(x);
    return Math.abs(n) >= 1000 ? Math.round(n).toLocaleString("en-US") : n.toFixed(digits);
  }

  function fmtBytes(n) {
    if (n === undefined || n === null) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    let v = Number(n);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return (i ? v.toFixed(1) : String(v)) + " " + units[i];
  }

  // 1.5k, 12M, 3.2G: token counts on an axis
  function fmtCount(n) {
    const v = Math.abs(n);
    for (const [div, suffix] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
      if (v >= div) return +(n / div).toFixed(v >= 10 * div ? 0 : 1) + suffix;
    }
    return String(+Number(n).toFixed(2));
  }

  // 45 s, 12 min, 3.5 h: elapsed wall time on an axis
  function fmtDuration(s) {
    const v = Math.abs(s);
    if (v < 120) return +Number(s).toFixed(v < 10 ? 1 : 0) + " s";
    if (v < 7200) return +(s / 60).toFixed(v < 600 ? 1 : 0) + " min";
    return +(s / 3600).toFixed(1) + " h";
  }

  function ago(t) {
    if (!t) return "-";
    const s = Math.max(0, Date.now() / 1000 - t);
    if (s < 90) return s.toFixed(1) + " s ago";
    if (s < 5400) return Math.round(s / 60) + " min ago";
    const d = new Date(t * 1000);
    const opts = { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" };
    if (d.getFullYear() !== new Date().getFullYear()) opts.year = "numeric";
    return d.toLocaleString([], opts);
  }

  function clock(t) {
    return t ? new Date(t * 1000).toLocaleTimeString() : "-";
  }

  function num(v) {
    return v === undefined || v === null ? null : Number(v);
  }

  function showMessage(text, kind) {
    const box = $("message");
    box.textContent = text;
    box.className = "message " + (kind || "info");
    box.hidden = !text;
  }

  class ApiError extends Error {
    constructor(status, message, key) {
      super(message);
      this.status = status;
      this.key = key || null;
    }
  }

  function runPath(id, tail) {
    return "v1/runs/" + encodeURIComponent(id) + (tail || "");
  }

  // Relative paths: the page works behind a reverse proxy that mounts it under a prefix.
  async function api(path, opts) {
    const o = opts || {};
    const headers = { Accept: o.text ? "text/plain" : "application/json" };
    if (o.contentType) headers["Content-Type"] = o.contentType;
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (o.auth && token) headers.Authorization = "Bearer " + token;
    const r = await fetch(path, {
      method: o.method || "GET", headers, body: o.body, cache: "no-store", credentials: "same-origin",
    });
    const text = await r.text();
    if (!r.ok) {
      let message = r.status + " " + r.statusText;
      let key = null;
      try {
        const body = JSON.parse(text);
        message = body.error || message;
        key = body.key || null;
      } catch (_) { /* not JSON: keep the status line */ }
      throw new ApiError(r.status, message, key);
    }
    if (o.text) return text;
    return text ? JSON.parse(text) : null;
  }

  function explain(err, what) {
    if (!(err instanceof ApiError)) return what + " failed: " + err.message;
    let text = what + " refused (" + err.status + "): " + err.message;
    if (err.key) text += "\nconfig key: " + err.key;
    if (err.status === 401) {
      text += "\nEnter the control plane's token (XTOKEN_CONTROL_TOKEN) under 'API token' above.";
      $("token-input").focus();
    }
    return text;
  }

  function chartWidth(host) {
    return Math.max(280, Math.floor(host.getBoundingClientRect().width) || 400);
  }

  window.xtoken = {
    TOKEN_KEY, STEP_INCRS, CHART_HEIGHT, $, el, setText, stateBadge, fmt, fmtBytes, fmtCount,
    fmtDuration, ago, clock, num, showMessage, ApiError, runPath, api, explain, chartWidth,
  };
})();
