// xtoken control plane dashboard: runs side by side. The runs ticked in the list (kept for this
// tab) are overlaid, one colour per run: loss (total, KD, CE), held-out bits/byte, tokens/s and
// memory on one x axis (steps, tokens seen or wall time since the run's first record), with an
// optional exponential moving average (TensorBoard's smoothing, debiased), and the config keys
// whose values differ. Data: GET v1/compare (services/control/routes/compare.py).
(function () {
  "use strict";

  const { $, el, api, fmt, fmtCount, fmtDuration, clock, chartWidth, STEP_INCRS, CHART_HEIGHT } =
    window.xtoken;
  const ACTIVE = new Set(["PENDING", "STARTING", "RUNNING", "RECOVERING", "STOPPING"]);
  const PICK_KEY = "xtoken.compare";  // sessionStorage: the ticked run ids, in ticking order
  const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#be185d",
    "#4d7c0f", "#475569", "#ea580c", "#0f766e", "#9333ea", "#b91c1c", "#1d4ed8", "#a16207", "#15803d"];
  const MIN_RUNS = 2;
  const MAX_RUNS = 16;       // the API's bound (services/control/compare.py MAX_RUNS)
  const POINTS = 1000;       // steps per run asked for (thinned evenly by the server)
  const REFRESH_MS = 5000;   // while a compared run is active
  // x axis -> the column of a run's steps and evals that holds it
  const X_COLUMNS = { step: "step", tokens: "tokens_seen", time: "elapsed_s" };
  const X_LABELS = { step: "step", tokens: "tokens", time: "wall time" };
  const CHARTS = [
    { id: "cmp-loss", from: "steps", field: "loss", digits: 4 },
    { id: "cmp-kd", from: "steps", field: "kl_loss", digits: 4 },
    { id: "cmp-ce", from: "steps", field: "ce_loss", digits: 4 },
    // evals are few: drawn as points, never smoothed
    { id: "cmp-bpb", from: "evals", field: "bits_per_byte", digits: 4, points: true, raw: true },
    { id: "cmp-tps", from: "steps", field: "tokens_per_s", digits: 0 },
    { id: "cmp-memory", from: "steps", field: "memory_mb", digits: 1 },
  ];

  const C = {
    picked: loadPicked(),  // run ids
    states: {},            // run id -> state, from the runs list
    reply: null,           // the last GET v1/compare
    x: "step",
    smooth: 0,
    charts: {},            // chart id -> uPlot
    shape: "",             // runs and x axis the charts were built for
    gen: 0,                // bumped by each fetch: an older reply is dropped
    fetchedAt: 0,
  };

  function loadPicked() {
    try {
      const ids = JSON.parse(sessionStorage.getItem(PICK_KEY) || "[]");
      return Array.isArray(ids) ? ids.filter((x) => typeof x === "string").slice(0, MAX_RUNS) : [];
    } catch (_) {
      return [];
    }
  }

  function savePicked() {
    sessionStorage.setItem(PICK_KEY, JSON.stringify(C.picked));
  }

  // ------------------------------------------------------------------ the runs list's side

  // The tick box of one row of the runs list (a click on it does not open the run).
  function checkbox(run) {
    return el("input", {
      type: "checkbox", class: "compare-pick", title: "compare this run with the other ticked ones",
      "aria-label": "compare run " + run.id, dataset: { runId: run.id },
      checked: C.picked.includes(run.id) ? "" : null,
      onclick: (ev) => ev.stopPropagation(),
      onchange: (ev) => toggle(run.id, ev.target.checked),
    });
  }

  function toggle(id, on) {
    C.picked = C.picked.filter((x) => x !== id);
    if (on) {
      if (C.picked.length >= MAX_RUNS) {
        window.xtoken.showMessage("at most " + MAX_RUNS + " runs can be compared at once", "error");
        syncBoxes();
        return;
      }
      C.picked.push(id);
    }
    savePicked();
    syncBoxes();
    refresh();
  }

  function syncBoxes() {
    for (const box of document.querySelectorAll("input.compare-pick")) {
      box.checked = C.picked.includes(box.dataset.runId);
    }
    $("compare-hint").hidden = C.picked.length >= MIN_RUNS;
  }

  // After each refresh of the runs list: forget runs that are gone, fetch again while one of
  // the compared runs is active.
  function runsChanged(runs) {
    C.states = Object.fromEntries(runs.map((r) => [r.id, r.state]));
    const kept = C.picked.filter((id) => id in C.states);
    if (kept.length !== C.picked.length) {
      C.picked = kept;
      savePicked();
      refresh();
    }
    syncBoxes();
    if (C.picked.length < MIN_RUNS) return;
    $("compare-panel").hidden = false;  // runs ticked before the page was loaded again
    const live = C.picked.some((id) => ACTIVE.has(C.states[id]));
    if (C.reply === null || (live && Date.now() - C.fetchedAt >= REFRESH_MS)) fetchCompare();
  }

  // ------------------------------------------------------------------ fetch and draw

  function refresh() {
    const on = C.picked.length >= MIN_RUNS;
    $("compare-panel").hidden = !on;
    if (!on) {
      C.gen += 1;
      C.reply = null;
      destroyCharts();
      return;
    }
    fetchCompare();
  }

  async function fetchCompare() {
    C.gen += 1;
    const gen = C.gen;
    const query = new URLSearchParams(C.picked.map((id) => ["run", id]));
    query.append("points", String(POINTS));
    C.fetchedAt = Date.now();
    try {
      const reply = await api("v1/compare?" + query.toString());
      if (gen !== C.gen) return;
      C.reply = reply;
      $("compare-status").textContent = reply.runs.length + " runs, at most " + POINTS +
        " points each \u00b7 fetched " + clock(Date.now() / 1000);
      draw();
    } catch (err) {
      if (gen === C.gen) $("compare-status").textContent = "compare: " + err.message;
    }
  }

  function destroyCharts() {
    for (const chart of Object.values(C.charts)) chart.destroy();
    C.charts = {};
    C.shape = "";
  }

  function label(run) {
    return run.name && run.name !== run.id ? run.name + " (" + run.id + ")" : run.id;
  }

  function xAxis() {
    if (C.x === "tokens") return { values: (u, ticks) => ticks.map(fmtCount) };
    if (C.x === "time") return { values: (u, ticks) => ticks.map(fmtDuration) };
    return { incrs: STEP_INCRS };
  }

  function xValue(v) {
    if (v === null || v === undefined) return "-";
    if (C.x === "tokens") return fmtCount(v);
    if (C.x === "time") return fmtDuration(v);
    return String(v);
  }

  function buildCharts(runs) {
    destroyCharts();
    for (const spec of CHARTS) {
      const host = $(spec.id).querySelector(".plot");
      host.replaceChildren();
      C.charts[spec.id] = new uPlot({
        width: chartWidth(host),
        height: CHART_HEIGHT,
        legend: { live: true },
        cursor: { drag: { x: true, y: false } },
        scales: { x: { time: false } },
        series: [{ label: X_LABELS[C.x], value: (u, v) => xValue(v) }].concat(runs.map((run, i) => ({
          label: label(run), stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
          points: { show: !!spec.points, size: 6 },
          value: (u, v) => (v === null || v === undefined ? "-" : fmt(v, spec.digits)),
        }))),
        axes: [xAxis(), { size: 60 }],
      }, [[]].concat(runs.map(() => [])), host);
    }
    C.shape = runs.map((r) => r.id).join(",") + "|" + C.x;
  }

  // TensorBoard's smoothing: an exponential moving average, debiased so that it starts at the
  // first value; gaps stay gaps.
  function smooth(ys, weight) {
    if (!weight) return ys;
    let last = 0;
    let n = 0;
    return ys.map((y) => {
      if (y === null || y === undefined || !Number.isFinite(y)) return null;
      last = last * weight + (1 - weight) * y;
      n += 1;
      return last / (1 - Math.pow(weight, n));
    });
  }

  // One run's [xs, ys] of a chart: the points with both values, in x order.
  function table(run, spec) {
    const cols = run[spec.from];
    const xs = cols[X_COLUMNS[C.x]] || [];
    const ys = spec.raw ? cols[spec.field] || [] : smooth(cols[spec.field] || [], C.smooth);
    const pairs = [];
    for (let i = 0; i < xs.length; i++) {
      if (xs[i] !== null && ys[i] !== null && ys[i] !== undefined) pairs.push([xs[i], ys[i]]);
    }
    pairs.sort((a, b) => a[0] - b[0]);
    return [pairs.map((p) => p[0]), pairs.map((p) => p[1])];
  }

  function draw() {
    const reply = C.reply;
    if (!reply) return;
    const runs = reply.runs;
    if (C.shape !== runs.map((r) => r.id).join(",") + "|" + C.x) buildCharts(runs);
    for (const spec of CHARTS) {
      const tables = runs.map((run) => table(run, spec));
      const fig = $(spec.id);
      fig.dataset.series = String(tables.filter((t) => t[0].length > 0).length);
      fig.dataset.points = String(tables.reduce((a, t) => a + t[0].length, 0));
      C.charts[spec.id].setData(uPlot.join(tables));
    }
    $("compare-count").textContent = String(runs.length);
    $("compare-panel").dataset.runs = String(runs.length);
    renderDiff(runs, reply.config_diff);
  }

  function shown(value) {
    return typeof value === "string" ? value : JSON.stringify(value);
  }

  function renderDiff(runs, diff) {
    const table = $("config-diff");
    table.tHead.replaceChildren(el("tr", {}, el("th", {}, "key"), ...runs.map((run, i) => {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = COLORS[i % COLORS.length];
      return el("th", { title: run.id }, swatch, label(run));
    })));
    table.tBodies[0].replaceChildren(...diff.map((row) => el("tr", { dataset: { key: row.key } },
      el("td", {}, row.key),
      ...runs.map((run) => (run.id in row.values
        ? el("td", {}, shown(row.values[run.id]))
        : el("td", { class: "absent" }, "(absent)"))),
    )));
    $("config-diff-empty").hidden = diff.length > 0;
  }

  // ------------------------------------------------------------------ controls

  for (const input of document.querySelectorAll("input[name='compare-x']")) {
    input.addEventListener("change", () => {
      if (!input.checked) return;
      C.x = input.value;
      draw();
    });
  }
  $("compare-smooth").addEventListener("input", (ev) => {
    C.smooth = Number(ev.target.value);
    $("compare-smooth-value").textContent = C.smooth.toFixed(2);
    draw();
  });
  $("compare-clear").addEventListener("click", () => {
    C.picked = [];
    savePicked();
    syncBoxes();
    refresh();
  });
  window.addEventListener("resize", () => {
    for (const [id, chart] of Object.entries(C.charts)) {
      chart.setSize({ width: chartWidth($(id).querySelector(".plot")), height: CHART_HEIGHT });
    }
  });

  window.xtoken.compare = { checkbox, runsChanged };
})();
