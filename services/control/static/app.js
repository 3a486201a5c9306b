// xtoken control plane dashboard: runs, start/stop/resume, live curves of one run (SSE),
// processes, queue depth, memory, events. Runs side by side: compare.js; helpers: lib.js.
//
// Every value that comes from the server (run names, configs, reasons, log lines) reaches the
// page as text (textContent, dataset, title), never parsed as markup. The bearer
// token lives in sessionStorage (this tab only) and travels only in the Authorization header of
// mutating calls; GETs and the event stream need none, so no secret ever goes into a URL.
(function () {
  "use strict";

  const {
    TOKEN_KEY, STEP_INCRS, CHART_HEIGHT, $, el, setText, stateBadge, fmt, fmtBytes, ago, clock,
    num, showMessage, ApiError, runPath, api, explain, chartWidth,
  } = window.xtoken;
  const compare = window.xtoken.compare;
  const ACTIVE = new Set(["PENDING", "STARTING", "RUNNING", "RECOVERING", "STOPPING"]);
  const RESUMABLE = new Set(["STOPPED", "FAILED", "INTERRUPTED"]);
  const PHASES = ["data_wait", "sync", "teacher_wait", "forward", "loss", "backward", "optimizer"];
  const PHASE_COLORS = {
    data_wait: "#94a3b8", sync: "#64748b", teacher_wait: "#f59e0b", forward: "#3b82f6",
    loss: "#8b5cf6", backward: "#10b981", optimizer: "#ef4444",
  };
  // every kind a run records (services/control/event_text.py gives each its sentence)
  const EVENT_KINDS = ["state", "launched", "exited", "recovering", "restarted", "failed",
    "data_complete", "stop_requested", "reattached", "unresponsive", "queue_restarted",
    "queue_unreachable"];
  // the KD lines of a run's teachers (teacher 0, 1, ...), dashed beside the total KD's blue
  const TEACHER_COLORS = ["#0891b2", "#7c3aed", "#ea580c", "#16a34a", "#db2777", "#ca8a04"];
  const TICK_MS = 2000;
  const MAX_EVENTS = 200;
  // the server keeps at most 2048 queue samples a run (thinned evenly past that); the page
  // appends new ones and thins its copy the same way past this bound
  const MAX_QUEUE_POINTS = 4096;
  // the columns of GET .../queue/history points
  const QUEUE = { time: 0, samples: 1, bytes_used: 2, leases: 3, parked_claims: 4, parked_puts: 5 };

  const S = {
    gen: 0,              // bumped by each select(): replies for an older selection are dropped
    selected: null,      // run id
    run: null,           // the last GET /v1/runs/{id}
    source: null,        // the EventSource of the selected run
    pending: null,       // metrics events that arrived while the history loads (null: none loading)
    steps: [],
    evals: [],
    queue: [],           // rows of GET .../queue/history (time, samples, bytes, leases, ...)
    queueLoaded: false,  // the recorded history came (an empty one too)
    lastQueue: null,     // the last GET .../queue
    charts: {},
    drawTimer: null,
    finalRefresh: false, // the selected run ended and its last figures were fetched
    fileName: "",
  };

  // ------------------------------------------------------------------ token

  function renderToken() {
    $("token-status").textContent = sessionStorage.getItem(TOKEN_KEY) ? "token set (this tab)" : "no token";
  }

  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("token-input").value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    $("token-input").value = "";
    renderToken();
  });
  $("token-clear").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    renderToken();
  });

  // ------------------------------------------------------------------ health and runs list

  async function refreshHealth() {
    try {
      const h = await api("healthz");
      $("health").textContent = h.status + " \u00b7 " + h.runs + " runs, " + h.active +
        " active \u00b7 up " + Math.round(h.uptime_s / 60) + " min";
    } catch (err) {
      $("health").textContent = "unreachable: " + err.message;
    }
  }

  async function refreshRuns() {
    let runs;
    try {
      runs = (await api("v1/runs")).runs;
    } catch (err) {
      return;
    }
    const rows = runs.slice().reverse().map((r) => el("tr",
      { dataset: { runId: r.id }, class: r.id === S.selected ? "selected" : "", onclick: () => select(r.id) },
      el("td", { class: "pick" }, compare.checkbox(r)),
      el("td", {}, el("code", {}, r.id)),
      el("td", {}, r.name),
      el("td", {}, stateBadge(r.state)),
      el("td", {}, r.step === null || r.step === undefined ? "-" : r.step),
      el("td", { title: updatedTitle(r) }, ago(r.updated)),
    ));
    $("runs").tBodies[0].replaceChildren(...rows);
    $("runs-empty").hidden = runs.length > 0;
    compare.runsChanged(runs);
  }

  // "updated" is the last step's time (before the first step, the last state change's)
  function updatedTitle(r) {
    const when = (t) => new Date(t * 1000).toLocaleString();
    const step = r.updated !== r.state_changed ? "last step " + when(r.updated) + "\n" : "no step yet\n";
    return step + "last state change " + when(r.state_changed || r.updated);
  }

  // ------------------------------------------------------------------ start a run

  $("start-file").addEventListener("change", async (ev) => {
    const file = ev.target.files && ev.target.files[0];
    if (!file) return;
    if (file.size > 1 << 20) {
      showMessage("the file is " + fmtBytes(file.size) + "; a run config over 1 MiB is refused (XTOKEN_CONTROL_MAX_BODY_BYTES)", "error");
      return;
    }
    S.fileName = file.name;
    $("start-config").value = await file.text();
  });

  $("start-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const text = $("start-config").value;
    if (!text.trim()) {
      showMessage("paste a run config (YAML or JSON) or choose a file first", "error");
      return;
    }
    const json = /\.json$/i.test(S.fileName) || /^\s*[{[]/.test(text);
    const name = $("start-name").value.trim();
    const query = name ? "?" + new URLSearchParams({ name }).toString() : "";
    $("start-button").disabled = true;
    try {
      const run = await api("v1/runs" + query, {
        method: "POST", body: text, auth: true,
        contentType: json ? "application/json" : "application/yaml",
      });
      showMessage("started run " + run.id + (run.name ? " (" + run.name + ")" : ""), "info");
      await refreshRuns();
      await select(run.id);
    } catch (err) {
      showMessage(explain(err, "start"), "error");
    } finally {
      $("start-button").disabled = false;
    }
  });

  // ------------------------------------------------------------------ stop and resume

  async function mutate(action) {
    const id = S.selected;
    if (!id) return;
    const button = $(action + "-button");
    button.disabled = true;
    try {
      const run = await api(runPath(id, "/" + action), { method: "POST", auth: true });
      showMessage(action === "stop"
        ? "stop requested: every trainer rank checkpoints at one step, then the run is STOPPED"
        : "resumed from the latest checkpoint", "info");
      if (id === S.selected) {
        S.finalRefresh = false;
        renderRun(run);
      }
      if (action === "resume" && id === S.selected) await select(id);
      refreshRuns();
    } catch (err) {
      showMessage(explain(err, action), "error");
      if (S.run) renderButtons(S.run.state);
    }
  }

  $("stop-button").addEventListener("click", () => mutate("stop"));
  $("resume-button").addEventListener("click", () => mutate("resume"));

  // ------------------------------------------------------------------ charts (uPlot)

  function makeChart(id, series, opts) {
    const fig = $(id);
    const host = fig.querySelector(".plot");
    host.replaceChildren();
    const o = opts || {};
    const chart = new uPlot({
      width: chartWidth(host),
      height: CHART_HEIGHT,
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      scales: { x: { time: !!o.time } },
      series: [{ label: o.time ? "time" : "step" }].concat(series.map((s) => ({
        label: s.label, stroke: s.color, width: 1.5, spanGaps: true, dash: s.dash,
        points: { show: !!o.points, size: 6 },
        value: (u, v) => (v === null || v === undefined ? "-" : fmt(v, s.digits === undefined ? 4 : s.digits)),
      }))),
      axes: [o.time ? {} : { incrs: STEP_INCRS }, { size: 60 }],
    }, [[]].concat(series.map(() => [])), host);
    return { fig, chart };
  }

  // The loss chart: total, KD, CE, then one KD line per teacher of a run of several teachers
  // (its steps carry teacher{i}_kl_loss; a run of one teacher has none).
  function lossChart(teachers) {
    const lines = [
      { label: "total", color: "#111827" },
      { label: "KD", color: "#2563eb" },
      { label: "CE", color: "#dc2626" },
    ];
    for (let i = 0; i < teachers; i++) {
      lines.push({ label: "teacher " + i, color: TEACHER_COLORS[i % TEACHER_COLORS.length], dash: [4, 3] });
    }
    const c = makeChart("chart-loss", lines);
    c.teachers = teachers;
    c.fig.dataset.teachers = String(teachers);
    c.fig.querySelector("figcaption").textContent = teachers
      ? "Loss (total, KD, CE, KD of each teacher) by step" : "Loss (total, KD, CE) by step";
    return c;
  }

  // teachers whose own KD term the steps carry (teacher0_kl_loss, teacher1_kl_loss, ...)
  function teacherCount(steps) {
    let n = 0;
    for (const s of steps) {
      while (("teacher" + n + "_kl_loss") in s) n++;
    }
    return n;
  }

  function buildCharts() {
    for (const c of Object.values(S.charts)) c.chart.destroy();
    S.charts = {
      loss: lossChart(0),
      tps: makeChart("chart-tps", [{ label: "tokens/s", color: "#059669", digits: 0 }]),
      times: makeChart("chart-times", PHASES.map((p) => ({ label: p, color: PHASE_COLORS[p], digits: 4 }))
        .concat([{ label: "total", color: "#111827", dash: [4, 3], digits: 4 }])),
      queue: makeChart("chart-queue", [
        { label: "samples held", color: "#7c3aed", digits: 0 },
        { label: "leases", color: "#ea580c", digits: 0 },
        { label: "claims waiting", color: "#64748b", digits: 0, dash: [4, 3] },
      ], { time: true }),
      bpb: makeChart("chart-bpb", [{ label: "bits/byte", color: "#0891b2" }], { points: true }),
      memory: makeChart("chart-memory", [{ label: "peak MiB", color: "#be185d", digits: 1 }]),
      onPolicy: makeChart("chart-on-policy", [
        { label: "mean staleness", color: "#7c3aed", digits: 2 },
        { label: "dropped stale", color: "#dc2626", digits: 0, dash: [4, 3] },
        { label: "teacher log-prob/byte", color: "#059669", digits: 4 },
      ]),
    };
  }

  window.addEventListener("resize", () => {
    for (const c of Object.values(S.charts)) {
      c.chart.setSize({ width: chartWidth(c.fig.querySelector(".plot")), height: CHART_HEIGHT });
    }
  });

  function scheduleDraw() {
    if (S.drawTimer === null) S.drawTimer = setTimeout(draw, 100);
  }

  function setSeries(name, data, points) {
    const c = S.charts[name];
    if (!c) return;
    c.chart.setData(data);
    c.fig.dataset.points = String(points);
  }

  function draw() {
    S.drawTimer = null;
    const x = S.steps.map((s) => s.step);
    const teachers = teacherCount(S.steps);
    if (S.charts.loss && S.charts.loss.teachers !== teachers) {  // a line per teacher: rebuilt
      S.charts.loss.chart.destroy();
      S.charts.loss = lossChart(teachers);
    }
    const perTeacher = [];
    for (let i = 0; i < teachers; i++) perTeacher.push(S.steps.map((s) => num(s["teacher" + i + "_kl_loss"])));
    setSeries("loss", [x, S.steps.map((s) => num(s.loss)), S.steps.map((s) => num(s.kl_loss)),
      S.steps.map((s) => num(s.ce_loss))].concat(perTeacher), x.length);
    setSeries("tps", [x, S.steps.map((s) => num(s.tokens_per_s))], x.length);
    setSeries("times", [x].concat(PHASES.map((p) => S.steps.map((s) => num((s.times || {})[p]))),
      [S.steps.map((s) => num(s.step_s))]), x.length);
    const evals = S.evals.filter((e) => e.bits_per_byte !== undefined && e.bits_per_byte !== null)
      .slice().sort((a, b) => a.step - b.step);
    setSeries("bpb", [evals.map((e) => e.step), evals.map((e) => num(e.bits_per_byte))], evals.length);
    setSeries("memory", [x, S.steps.map((s) => num(s.memory_mb))],
      S.steps.filter((s) => s.memory_mb !== undefined && s.memory_mb !== null).length);
    drawOnPolicy(x);
    drawQueue();
    renderFacts();
  }

  // On-policy runs only: the chart shows once a step carries on-policy figures.
  function drawOnPolicy(x) {
    const op = S.steps.map((s) => s.on_policy || null);
    const fig = $("chart-on-policy");
    const shown = !fig.hidden;
    fig.hidden = !op.some((o) => o !== null);
    if (fig.hidden) return;
    if (!shown && S.charts.onPolicy) {  // sized while hidden: size it now
      S.charts.onPolicy.chart.setSize({ width: chartWidth(fig.querySelector(".plot")), height: CHART_HEIGHT });
    }
    setSeries("onPolicy", [x, op.map((o) => num(o && o.mean_staleness)),
      op.map((o) => num(o && o.dropped_stale)), op.map((o) => num(o && o.teacher_logprob_per_byte))],
      op.filter((o) => o !== null).length);
  }

  // A step at or before the last one is a replay after a restart from a checkpoint: the curve
  // goes back to that step and continues from there.
  function addStep(rec) {
    if (typeof rec.step !== "number") return;
    while (S.steps.length && S.steps[S.steps.length - 1].step >= rec.step) S.steps.pop();
    S.steps.push(rec);
    scheduleDraw();
  }

  function addEval(rec) {
    S.evals.push(rec);
    scheduleDraw();
  }

  function onMetrics(data) {
    if (S.pending !== null) {
      S.pending.push(data);
      return;
    }
    if (data.kind === "step") addStep(data);
    else if (data.kind === "eval") addEval(data);
  }

  // ------------------------------------------------------------------ the selected run

  function renderButtons(state) {
    $("stop-button").disabled = !ACTIVE.has(state) || state === "STOPPING";
    $("resume-button").disabled = !RESUMABLE.has(state);
  }

  function renderRun(run) {
    S.run = run;
    $("run-id").textContent = run.id;
    $("run-name").textContent = run.name ? "(" + run.name + ")" : "";
    $("run-state").replaceChildren(stateBadge(run.state));
    $("run-state").dataset.state = run.state;
    renderButtons(run.state);
    let reason = run.reason || "";
    if (run.state === "RECOVERING" && run.attempt) reason += " (attempt " + run.attempt + ")";
    if (run.failed_process) {
      reason += "\nprocess " + run.failed_process + ", exit code " + (run.exit_code === null ? "?" : run.exit_code);
    }
    $("run-reason").textContent = reason;
    $("failure").hidden = !run.log_tail;
    $("failure-tail").textContent = run.log_tail || "";
    setText("fact-checkpoint", run.checkpoint ? "step " + run.checkpoint.step : null);
    $("fact-checkpoint").title = run.checkpoint ? run.checkpoint.path : "";
    $("run-dir").textContent = run.run_dir || "";
    if (run.config) $("run-config").textContent = JSON.stringify(run.config, null, 2);
    for (const tr of $("runs").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.runId === run.id);
    renderFacts();
  }

  function renderFacts() {
    const last = S.steps.length ? S.steps[S.steps.length - 1] : (S.run && S.run.latest_metrics);
    setText("fact-step", last ? last.step : (S.run ? S.run.step : null));
    setText("fact-loss", last ? [last.loss, last.kl_loss, last.ce_loss].map((v) => fmt(v, 4)).join(" / ") : null);
    setText("fact-tps", last ? fmt(last.tokens_per_s, 1) : null);
    setText("fact-step-s", last && last.step_s !== undefined ? fmt(last.step_s, 3) + " s" : null);
    setText("fact-memory", last && last.memory_mb !== undefined && last.memory_mb !== null
      ? fmtBytes(last.memory_mb * 1048576) : null);
    renderSplit(last);
    const evals = S.evals.filter((e) => e.bits_per_byte !== undefined && e.bits_per_byte !== null);
    const ev = evals.length ? evals[evals.length - 1] : null;
    setText("fact-bpb", ev ? fmt(ev.bits_per_byte, 4) + " (" + (ev.tag || "step " + ev.step) + ")" : null);
    const op = last && last.on_policy;
    $("fact-on-policy-box").hidden = !op;
    setText("fact-on-policy", op ? [op.samples, fmt(op.mean_staleness, 2), op.dropped_stale].join(" / ") : null);
    const gen = (S.run && S.run.rollouts) || [];
    $("fact-generated-box").hidden = gen.length === 0;
    const sum = (k) => gen.reduce((a, r) => a + (Number(r[k]) || 0), 0);
    setText("fact-generated", gen.length ? fmt(sum("tokens_per_s"), 1) + " (" + fmt(sum("samples_per_s"), 2) + ")" : null);
  }

  function renderSplit(last) {
    const box = $("split");
    const times = (last && last.times) || {};
    const total = PHASES.reduce((a, p) => a + (Number(times[p]) || 0), 0);
    const parts = [];
    if (total > 0) {
      for (const p of PHASES) {
        const v = Number(times[p]) || 0;
        if (v <= 0) continue;
        const span = el("span", { title: p + ": " + fmt(v, 4) + " s (" + (100 * v / total).toFixed(1) + "%)" });
        span.style.width = (100 * v / total) + "%";
        span.style.background = PHASE_COLORS[p];
        parts.push(span);
      }
    }
    box.replaceChildren(...parts);
  }

  function renderQueue(q) {
    const stats = q && q.stats;
    if (!stats) {  // not asked by this control plane: the last sample recorded, if any
      const last = S.queue.length ? S.queue[S.queue.length - 1] : null;
      setText("fact-queue", last ? last[QUEUE.samples] + " samples \u00b7 " +
        fmtBytes(last[QUEUE.bytes_used]) + " (recorded " + ago(last[QUEUE.time]) + ")" : null);
      $("fact-queue").title = "";
      return;
    }
    const parts = Object.entries(stats.partitions || {})
      .map(([name, p]) => name + ": " + p.samples + " samples, " + fmtBytes(p.bytes)).join("\n");
    setText("fact-queue", stats.samples + " samples \u00b7 " + fmtBytes(stats.bytes_used) + " / " +
      fmtBytes(stats.capacity_bytes) + " \u00b7 " + stats.leases + " leased \u00b7 " +
      num(stats.parked_claims) + " claims waiting");
    $("fact-queue").title = parts;
  }

  // The queue depth the control plane sampled (kept with the run): a finished run shows what was
  // recorded, or says that nothing was, instead of an empty time axis.
  function drawQueue() {
    const fig = $("chart-queue");
    const empty = S.queueLoaded && S.queue.length === 0;
    fig.dataset.empty = empty ? "1" : "0";
    $("queue-empty").hidden = !empty;
    const host = fig.querySelector(".plot");
    const shown = !host.hidden;
    host.hidden = S.queue.length === 0;
    if (!S.queue.length) {
      fig.dataset.points = "0";
      return;
    }
    if (!shown && S.charts.queue) {  // sized while hidden: size it now
      S.charts.queue.chart.setSize({ width: chartWidth(host), height: CHART_HEIGHT });
    }
    setSeries("queue", [QUEUE.time, QUEUE.samples, QUEUE.leases, QUEUE.parked_claims]
      .map((i) => S.queue.map((q) => q[i])), S.queue.length);
  }

  async function refreshQueueHistory(gen) {
    const after = S.queue.length ? S.queue[S.queue.length - 1][QUEUE.time] : null;
    const query = after === null ? "" : "?" + new URLSearchParams({ after: String(after) });
    try {
      const h = await api(runPath(S.selected, "/queue/history" + query));
      if (gen !== S.gen) return;
      S.queue.push(...h.points);
      if (S.queue.length > MAX_QUEUE_POINTS) S.queue = S.queue.reverse().filter((_, i) => i % 2 === 0).reverse();
      S.queueLoaded = true;
      if (h.points.length && !(S.lastQueue && S.lastQueue.stats)) renderQueue(S.lastQueue);
      scheduleDraw();
    } catch (_) { /* the next tick tries again */ }
  }

  function renderProcesses(procs) {
    const rows = procs.map((p) => el("tr", { dataset: { process: p.name } },
      el("td", {}, p.name),
      el("td", {}, p.role),
      el("td", {}, p.host),
      el("td", {}, p.pid === null ? "-" : p.pid),
      el("td", {}, p.gpu === null ? "-" : p.gpu),
      el("td", { class: /^[a-z]+$/.test(p.state) ? "proc-" + p.state : "" }, p.state),
      el("td", {}, p.restarts),
      el("td", { title: p.last_heartbeat ? new Date(p.last_heartbeat * 1000).toLocaleString() : "" }, ago(p.last_heartbeat)),
      el("td", {}, p.exit_code === null ? "-" : p.exit_code),
      el("td", {}, el("button", { type: "button", onclick: () => showLog(p.name) }, "log")),
    ));
    $("processes").tBodies[0].replaceChildren(...rows);
  }

  async function showLog(process) {
    const id = S.selected;
    try {
      const text = await api(runPath(id, "/logs?" + new URLSearchParams({ process, lines: "200" })), { text: true });
      $("log-process").textContent = process;
      $("log-text").textContent = text || "(empty)";
      $("log-box").hidden = false;
    } catch (err) {
      showMessage(explain(err, "log"), "error");
    }
  }
  $("log-close").addEventListener("click", () => { $("log-box").hidden = true; });

  // each recorded event comes with its sentence (``text``); the compact line is for a server
  // that sends none
  function addEvent(ev) {
    const data = ev.data || {};
    let text = ev.text || (ev.kind + " " + Object.entries(data)
      .map(([k, v]) => k + "=" + (typeof v === "string" ? v : JSON.stringify(v))).join(" "));
    if (text.length > 400) text = text.slice(0, 400) + "...";
    const li = el("li", { dataset: { kind: ev.kind }, title: ev.kind + " " + JSON.stringify(data) },
      el("time", {}, clock(ev.time)), " ", text);
    const list = $("events");
    list.prepend(li);
    while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
  }

  async function refreshRun(gen) {
    try {
      const run = await api(runPath(S.selected));
      if (gen === S.gen) renderRun(run);
    } catch (err) {
      if (gen === S.gen && err instanceof ApiError && err.status === 404) {
        showMessage("run " + S.selected + " is gone: " + err.message, "error");
      }
    }
  }

  async function refreshProcesses(gen) {
    try {
      const out = await api(runPath(S.selected, "/processes"));
      if (gen === S.gen) renderProcesses(out.processes);
    } catch (_) { /* the next tick tries again */ }
  }

  async function refreshQueue(gen) {
    try {
      const q = await api(runPath(S.selected, "/queue"));
      if (gen !== S.gen) return;
      S.lastQueue = q;
      renderQueue(q);
    } catch (_) { /* the next tick tries again */ }
  }

  async function loadHistory(gen) {
    S.pending = S.pending || [];
    const after = S.steps.length ? S.steps[S.steps.length - 1].step : -1;
    try {
      const hist = await api(runPath(S.selected, "/metrics?after_step=" + after));
      if (gen !== S.gen) return;
      hist.steps.forEach(addStep);
      if (after < 0) hist.evals.forEach(addEval);
    } catch (_) { /* shown as an empty chart; the stream still feeds it */ }
    if (gen !== S.gen) return;
    const buffered = S.pending || [];
    S.pending = null;
    buffered.forEach(onMetrics);
  }

  function openEvents(gen) {
    const source = new EventSource(runPath(S.selected, "/events"));
    S.source = source;
    source.addEventListener("open", () => {
      // the first open and every reconnect: the server subscribed us before it answered, so
      // the history fetched now misses no step (metrics events are live only, never replayed);
      // live ones are buffered until it is in
      if (gen === S.gen) loadHistory(gen);
    });
    source.addEventListener("error", () => {
      // refused for good (not a dropped connection, which EventSource retries): the history
      // alone, the clock refreshes the rest
      if (gen === S.gen && source.readyState === EventSource.CLOSED) loadHistory(gen);
    });
    source.addEventListener("metrics", (e) => {
      if (gen === S.gen) onMetrics(JSON.parse(e.data).data);
    });
    for (const kind of EVENT_KINDS) {
      source.addEventListener(kind, (e) => {
        if (gen !== S.gen) return;
        const ev = JSON.parse(e.data);
        addEvent(ev);
        if (kind === "state") {
          S.finalRefresh = false;
          if (S.run) renderRun(Object.assign({}, S.run, { state: ev.data.state, reason: ev.data.reason }));
          refreshRun(gen);
          refreshRuns();
          refreshHealth();
        }
        if (kind !== "state") refreshProcesses(gen);
      });
    }
  }

  async function select(id) {
    if (S.source) S.source.close();
    S.gen += 1;
    const gen = S.gen;
    Object.assign(S, {
      selected: id, run: null, source: null, pending: [], steps: [], evals: [], queue: [],
      queueLoaded: false, lastQueue: null, finalRefresh: false,
    });
    history.replaceState(null, "", "#run=" + encodeURIComponent(id));
    $("run-panel").hidden = false;
    $("events").replaceChildren();
    $("log-box").hidden = true;
    $("processes").tBodies[0].replaceChildren();
    $("run-config").textContent = "";
    buildCharts();
    openEvents(gen);   // then the history, once the stream is open
    await refreshRun(gen);
    scheduleDraw();
    refreshProcesses(gen);
    refreshQueue(gen);
    refreshQueueHistory(gen);
  }

  // ------------------------------------------------------------------ the clock

  async function tick() {
    refreshRuns();
    if (!S.selected) return;
    const gen = S.gen;
    const active = S.run && ACTIVE.has(S.run.state);
    if (active || !S.finalRefresh) {
      if (S.run && !active) S.finalRefresh = true;
      await refreshRun(gen);
      refreshProcesses(gen);
      refreshQueue(gen);
      refreshQueueHistory(gen);
    }
  }

  renderToken();
  refreshHealth();
  setInterval(refreshHealth, 10000);
  setInterval(tick, TICK_MS);
  refreshRuns().then(() => {
    const m = /^#run=(.+)$/.exec(location.hash);
    if (m) select(decodeURIComponent(m[1]));
    document.body.dataset.ready = "1";
  });
})();
