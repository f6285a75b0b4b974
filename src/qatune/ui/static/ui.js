// qatune ui: the page's script. Plain JavaScript, no build step, nothing loaded from elsewhere.
// Each step calls qatune ui's JSON API (/api/...) and shows the qatune command it ran. The server keeps what runs, so
// a page closed or reloaded asks it (/api/state) and comes back to where it was.
"use strict";

const $ = (id) => document.getElementById(id);
const STEPS = ["sheet", "check", "train", "compare", "try"];
const POLL_MS = 1000;
let state = null; // GET /api/state
let described = null; // the sheet as /api/sheets describes it
let written = null; // the config the Sheet step wrote
let run = null; // "runs/NAME": the run the later steps work on
let checkReport = null;
let progressTimer = null;
let tried = null; // the run loaded behind /try

// --- talking to the server

const key = () => sessionStorage.getItem("qatune-key") || ""; // also what serve's page (in the frame) reads

function headers(contentType) {
  const h = contentType ? { "Content-Type": contentType } : {};
  if (key()) h.Authorization = "Bearer " + key();
  return h;
}

async function api(path, options = {}) {
  const isFile = options.body instanceof Blob;
  const response = await fetch(path, {
    ...options, headers: headers(options.body ? (isFile ? "application/octet-stream" : "application/json") : null),
  });
  if (response.status === 401) $("key-box").classList.remove("hidden");
  let body = null;
  try { body = await response.json(); } catch (_) { /* not JSON */ }
  if (!response.ok) {
    throw new Error(body && body.error ? body.error.message : response.status + " " + response.statusText);
  }
  return body;
}

const post = (path, body) => api(path, { method: "POST", body: JSON.stringify(body) });
const runName = (path) => path.split("/").pop();
const fileUrl = (path) => "/api/files/" + path.split("/").map(encodeURIComponent).join("/");

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function setStatus(id, text, kind = "") {
  $(id).textContent = text;
  $(id).className = "status " + kind;
}

async function download(url, filename) {
  if (!key()) { // a plain link: the browser saves it as it comes
    const link = el("a", { href: url, download: filename || "" });
    document.body.append(link);
    link.click();
    link.remove();
    return;
  }
  const response = await fetch(url, { headers: headers(null) }); // the key goes in a header: fetch, then save
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  const link = el("a", { href: URL.createObjectURL(await response.blob()), download: filename || "" });
  document.body.append(link);
  link.click();
  link.remove();
}

function downloadLink(path, text) {
  return el("a", { href: fileUrl(path), class: "download", "data-path": path, onclick: (event) => {
    event.preventDefault();
    download(fileUrl(path), runName(path)).catch((e) => pageError(e.message));
  } }, text || path);
}

function pageError(message) {
  $("page-error").textContent = message;
  $("page-error").classList.toggle("hidden", !message);
}

async function poll(job, render) {
  render(job);
  if (job.state === "running") {
    setTimeout(async () => {
      try { await poll(await api("/api/jobs/" + job.id), render); } catch (e) { pageError(e.message); }
    }, POLL_MS);
  }
}

function command(id, text) {
  $(id).textContent = "$ " + text;
  $(id).classList.remove("hidden");
}

// --- the steps

function show(step) {
  for (const name of STEPS) $("step-" + name).classList.toggle("hidden", name !== step);
  for (const button of document.querySelectorAll("nav button")) {
    button.classList.toggle("current", button.dataset.step === step);
  }
  sessionStorage.setItem("qatune-step", step);
  document.body.dataset.step = step;
  if (step === "compare") fillCompareChoices();
  if (step === "try") enterTry();
}

function updateNav() {
  const ready = { sheet: true, check: !!written, train: !!written || !!run, compare: !!run, try: !!run };
  for (const button of document.querySelectorAll("nav button")) button.disabled = !ready[button.dataset.step];
}

// 1. Sheet

async function uploadSheet(file, purpose) {
  if (state && file.size > state.max_upload_bytes) {
    throw new Error(file.name + " is larger than the upload limit of " + Math.round(state.max_upload_bytes / 2 ** 20) +
                    " MB; start qatune ui with a larger --max-upload-mb");
  }
  const query = "?name=" + encodeURIComponent(file.name) + (purpose ? "&purpose=" + purpose : "");
  return api("/api/sheets" + query, { method: "POST", body: file });
}

async function takeSheet(file) {
  $("sheet-error").textContent = "";
  $("sheet-form").classList.add("hidden");
  setStatus("sheet-status", "reading " + file.name + " …");
  try {
    renderSheet(await uploadSheet(file));
    setStatus("sheet-status", "");
    await refreshState();
  } catch (e) {
    setStatus("sheet-status", "");
    $("sheet-error").textContent = e.message;
    document.body.dataset.sheet = "error";
  }
}

async function openSheet(name, sheetName) {
  $("sheet-error").textContent = "";
  try {
    const query = sheetName ? "?sheet_name=" + encodeURIComponent(sheetName) : "";
    renderSheet(await api("/api/sheets/" + encodeURIComponent(name) + query));
  } catch (e) {
    $("sheet-form").classList.add("hidden");
    $("sheet-error").textContent = e.message;
    document.body.dataset.sheet = "error";
  }
}

function options(select, items, chosen) {
  select.replaceChildren(...items.map(([value, label]) => el("option", { value }, label)));
  if (chosen !== undefined && chosen !== null) select.value = chosen;
}

function checkboxes(box, names, prefix) {
  box.replaceChildren(...names.map((name) => el("label", {},
    el("input", { type: "checkbox", value: name, "data-group": prefix }), " " + name)));
}

function renderSheet(d) {
  described = d;
  const columns = d.columns.map((c) => c.name);
  const guess = (role) => (d.guesses && d.guesses[role] ? d.guesses[role] : { column: null, reason: "" });
  $("sheet-summary").textContent = d.sheet + (d.sheet_name !== null ? " (sheet " + d.sheet_name + ")" : "") + ": " +
    d.rows + " rows, columns " + d.columns.map((c) => c.name + " (e.g. " + JSON.stringify(c.sample) + ")").join(", ");
  $("sheet-message").textContent = d.message || "";
  $("sheet-picker-box").classList.toggle("hidden", d.sheets.length < 2);
  options($("sheet-picker"), d.sheets.map((s) => [s, s]), d.sheet_name);
  const named = columns.map((c) => [c, c]);
  options($("question"), named, guess("question").column);
  options($("answer"), named, guess("answer").column);
  options($("context"), [["", "(none)"], ...named], guess("context").column || "");
  $("why-question").textContent = guess("question").reason;
  $("why-answer").textContent = guess("answer").reason;
  $("why-context").textContent = guess("context").reason;
  $("task").textContent = d.task;
  $("why-task").textContent = guess("task").reason;
  checkboxes($("answer-fields"), columns, "answers");
  checkboxes($("prompt-columns"), columns, "prompt");
  $("held-out").value = Math.round(d.held_out * 100);
  const models = d.models.map((m) => [m.value, m.label]);
  options($("model"), [...models, ["__other__", "a hub id or a folder in the workspace …"]],
          models.length ? models[0][0] : "__other__");
  $("run-name").value = d.run;
  modelChanged();
  $("sheet-form").classList.toggle("hidden", d.columns.length === 0);
  document.body.dataset.sheet = "read";
}

function modelChanged() {
  const other = $("model").value === "__other__";
  $("model-other").classList.toggle("hidden", !other);
  $("why-epochs").textContent = "empty: " + ($("model").value === "scratch" ? "40 (a model from scratch needs many)"
                                                                              : "3, as qatune init writes");
}

function checked(group) {
  return [...document.querySelectorAll(`input[data-group="${group}"]:checked`)].map((input) => input.value);
}

async function writeConfig(event) {
  event.preventDefault();
  $("sheet-error").textContent = "";
  const answers = [$("answer").value, ...checked("answers").filter((c) => c !== $("answer").value)];
  const choices = {
    sheet: described.sheet, sheet_name: described.sheets.length ? $("sheet-picker").value : null,
    question: $("question").value, answers, context: $("context").value || null,
    prompt_columns: checked("prompt"), held_out: Number($("held-out").value || 0) / 100,
    model: $("model").value === "__other__" ? $("model-other").value : $("model").value,
    epochs: $("epochs").value ? Number($("epochs").value) : null, run: $("run-name").value,
  };
  try {
    written = await post("/api/configs", choices);
    run = written.run;
    renderWritten(written);
    checkReport = null;
    $("check-report").replaceChildren();
    setStatus("check-status", "");
    await refreshState();
  } catch (e) {
    $("sheet-error").textContent = e.message;
  }
}

function renderWritten(w) {
  $("sheet-cli").classList.remove("hidden");
  command("sheet-command", w.command);
  $("sheet-changed").textContent = w.changed && w.changed.length ? "then, on the page: " + w.changed.join("; ") : "";
  $("sheet-config-link").replaceWith(Object.assign(downloadLink(w.config), { id: "sheet-config-link" }));
  for (const link of document.querySelectorAll(".config-link")) {
    link.replaceWith(Object.assign(downloadLink(w.config), { className: "config-link download" }));
  }
  $("config-yaml").value = w.yaml;
  updateNav();
}

async function saveConfig() {
  try {
    const saved = await api("/api/configs/" + written.config, {
      method: "PUT", body: JSON.stringify({ yaml: $("config-yaml").value }),
    });
    written.yaml = saved.yaml;
    setStatus("config-status", "saved; check it again", "good");
  } catch (e) {
    setStatus("config-status", e.message, "error");
  }
}

// 2. Check

async function runCheck() {
  try {
    await poll(await post("/api/check", { config: written.config }), renderCheck);
  } catch (e) {
    setStatus("check-status", e.message, "error");
  }
}

function renderCheck(job) {
  $("check-cli").classList.remove("hidden");
  command("check-command", job.command);
  $("check-status").dataset.state = job.state;
  $("run-check").disabled = job.state === "running";
  if (job.state === "running") {
    setStatus("check-status", "checking … " + (job.log.slice(-1)[0] || ""));
    return;
  }
  const report = job.result || {};
  checkReport = report;
  if (report.error) {
    setStatus("check-status", report.error, "error");
    $("check-report").replaceChildren();
  } else {
    setStatus("check-status", report.ok ? "fit to train" : "NOT fit to train: fix the errors below",
              report.ok ? "good" : "error");
    $("check-report").replaceChildren(...renderReport(report));
  }
  $("check-status").dataset.ok = report.ok ? "yes" : "no";
  $("train-start").disabled = !report.ok;
  if (report.ok) $("check-report").append(el("button", { class: "next", onclick: () => show("train") }, "Next: train"));
}

const rowList = (rows) => rows.slice(0, 10).join(", ") + (rows.length > 10 ? " and " + (rows.length - 10) + " more" : "");

function marked(text) { // ⟦trained tokens⟧ as <mark>
  return text.split(/(⟦[\s\S]*?⟧)/).map((part) => part.startsWith("⟦") ? el("mark", {}, part.slice(1, -1)) : part);
}

function renderReport(r) {
  const parts = [];
  const findings = r.findings || [];
  const errors = findings.filter((f) => f.level === "error");
  const warnings = findings.filter((f) => f.level === "warning");
  parts.push(el("h3", {}, "Findings: " + errors.length + " errors, " + warnings.length + " warnings"));
  parts.push(el("ul", { id: "findings" }, [...errors, ...warnings].map((f) =>
    el("li", { class: "finding-" + f.level }, f.level + " [" + f.code + "]: " + f.message))));
  parts.push(el("h3", {}, "Rows"));
  const rows = [];
  for (const [name, file] of Object.entries(r.files)) {
    if (name === "encoding" || name === "validation") continue;
    rows.push(el("li", {}, name + ": " + file.file + ": " + file.rows_read + " rows read, " + file.kept + " kept, " +
                 file.duplicates + " duplicates"));
    for (const [reason, dropped] of Object.entries(file.dropped)) {
      rows.push(el("li", { class: "warning" },
                   "dropped " + dropped.length + " (" + reason + "): rows " + rowList(dropped)));
    }
  }
  const validation = r.files.validation || {};
  rows.push(el("li", {}, "held out for validation: " + (validation.rows ? validation.rows + " rows" +
    (validation.file ? " of " + validation.file : " (" + Math.round(100 * validation.fraction) + "% of the questions)")
    : "none")));
  rows.push(el("li", {}, "questions in both training and validation: " + r.leakage.count));
  parts.push(el("ul", {}, rows));
  const l = r.lengths;
  parts.push(el("h3", {}, "Tokens"));
  const tokens = [el("li", {}, l.what + ": min " + l.min + ", median " + l.median + ", p95 " + l.p95 + ", max " + l.max),
                  el("li", {}, "max_length: " + r.max_length)];
  if (r.truncated_rows) {
    tokens.push(el("li", {}, "rows cut to fit: " + (r.truncated_rows.length ? rowList(r.truncated_rows) : "none")));
  }
  if (r.dropped_rows && r.dropped_rows.length) {
    tokens.push(el("li", { class: "warning" }, "dropped, too long: rows " + rowList(r.dropped_rows)));
  }
  parts.push(el("ul", {}, tokens));
  parts.push(el("h3", {}, "What is trained (the trained tokens marked)"));
  if (r.supervision) {
    const s = r.supervision;
    parts.push(el("p", {}, "supervised tokens per example: min " + s.min + ", mean " + s.mean.toFixed(1) +
      "; end token trained: " + (s.eos_supervised ? "yes" : "NO") + " (" + JSON.stringify(s.end_token) +
      "); prompt trained: " + (s.train_on_prompt ? "yes" : "no")));
  }
  if (r.span_audit) {
    const a = r.span_audit;
    parts.push(el("p", {}, "labelled spans that decode to the answer: " + a.matched + "/" + a.checked));
  }
  if (r.prompt_template) parts.push(el("p", {}, "prompt template: ", el("code", {}, JSON.stringify(r.prompt_template))));
  for (const example of r.examples || []) parts.push(el("pre", { class: "example" }, marked(example)));
  if (r.fields) parts.push(...renderFields(r.fields));
  const memory = r.memory;
  parts.push(el("h3", {}, "Memory (estimated peak per process; batch of " + memory.batch[0] + " rows × " +
                          memory.batch[1] + " tokens)"));
  parts.push(el("table", {}, el("tr", {}, el("th", {}, "set-up"), el("th", {}, "GiB"), el("th", {}, "of which"),
                                el("th", {}, "")),
    memory.setups.map((s) => el("tr", {}, el("td", {}, s.setup + (s.setup === memory.configured ? " (this config)" : "")),
      el("td", {}, s.total_gib.toFixed(2)),
      el("td", { class: "muted" }, Object.entries(s.parts_gib).map(([k, v]) => k + " " + v.toFixed(2)).join(", ")),
      el("td", { class: s.fits ? "good" : "error" }, s.fits ? "fits" : "does NOT fit")))));
  parts.push(el("p", { class: "muted" }, "available: " + memory.available_gib.toFixed(1) + " GiB (" + memory.device + ")"));
  return parts;
}

function renderFields(fields) {
  const parts = [el("h3", {}, "Answer fields"),
                 el("p", {}, "answer template: ", el("code", {}, JSON.stringify(fields.template)))];
  const rows = Object.entries(fields.columns).map(([name, f]) => el("tr", {}, el("td", {}, name),
    el("td", {}, f.kind + " (" + f.kind_from + ")"),
    el("td", {}, f.counts ? Object.entries(f.counts).map(([v, n]) => v + ": " + n).join(", ") : f.distinct + " distinct"),
    el("td", { class: "warning" }, f.eval_only.length ? "in validation only: " + f.eval_only.join(", ") : "")));
  parts.push(el("table", {}, el("tr", {}, el("th", {}, "field"), el("th", {}, "kind"), el("th", {}, "training rows"),
                                el("th", {}, "")), rows));
  return parts;
}

// 3. Train

async function startTraining(how) { // "start", "resume" (a stopped run), or "again" (replacing the run)
  $("train-error").textContent = "";
  try {
    const job = await post("/api/train", how === "resume" ? { resume: run }
                                         : { config: written.config, overwrite: how === "again" });
    run = job.target;
    await refreshState();
    watchProgress();
  } catch (e) {
    $("train-error").textContent = e.message;
  }
}

async function stopTraining() {
  const job = state.jobs.train;
  if (!job) return;
  $("train-stop").disabled = true;
  try { await post("/api/jobs/" + job.id + "/stop", {}); } catch (e) { $("train-error").textContent = e.message; }
}

function watchProgress() {
  clearTimeout(progressTimer);
  const tick = async () => {
    let p;
    try {
      p = await api("/api/runs/" + encodeURIComponent(runName(run)) + "/progress");
    } catch (e) {
      $("train-error").textContent = e.message;
      return;
    }
    renderProgress(p);
    if (p.job && p.job.state === "running") progressTimer = setTimeout(tick, POLL_MS);
    else await refreshState();
  };
  tick();
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const m = Math.floor(seconds / 60), s = Math.round(seconds % 60);
  return m ? m + " min " + s + " s" : s + " s";
}

function renderProgress(p) {
  const job = p.job;
  const running = job && job.state === "running";
  // run.json says running of a training that ended before it wrote its end (stopped while loading, killed)
  const recorded = job && !running && p.status === "running" ? job.state : p.status;
  const status = running ? (job.stopping ? "stopping: finishing the step, saving a checkpoint" : "training")
                         : (recorded || (job ? job.state : "not started"));
  const stat = (label, value, id) => el("div", { id }, el("span", {}, label), el("b", {}, value));
  $("train-stats").replaceChildren(
    stat("status", status, "stat-status"),
    stat("step", p.step + (p.total_steps ? " / " + p.total_steps : ""), "stat-step"),
    stat("epoch", (p.epoch || "–") + (p.epochs ? " / " + p.epochs : ""), "stat-epoch"),
    stat("tokens/s", p.tokens_per_s ? Math.round(p.tokens_per_s) : "–", "stat-tokens"),
    stat("elapsed", duration(p.elapsed_s), "stat-elapsed"),
    stat("time left", running ? duration(p.remaining_s) : "–", "stat-left"));
  $("train-stats").dataset.status = p.status || "";
  $("train-stats").dataset.step = String(p.step);
  $("train-stats").dataset.running = running ? "yes" : "no";
  drawCurve(p);
  $("train-log").textContent = job ? job.log.join("\n") : "";
  $("train-log").scrollTop = $("train-log").scrollHeight;
  if (job && job.state === "failed" && job.error) $("train-error").textContent = job.error;
  $("train-cli").classList.toggle("hidden", !job);
  if (job) command("train-command", job.command);
  $("train-run").textContent = p.run;
  $("train-start").classList.toggle("hidden", !!p.status);
  $("train-again").classList.toggle("hidden", running || !p.status || !written || written.run !== p.run);
  $("train-stop").disabled = !running || job.stopping;
  $("train-resume").classList.toggle("hidden", running || p.status !== "stopped");
  $("train-next").classList.toggle("hidden", p.status !== "complete");
}

function drawCurve(p) {
  const svg = $("curve");
  const ns = "http://www.w3.org/2000/svg";
  const node = (tag, attributes, text) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attributes)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    return n;
  };
  const train = p.train.filter((point) => point[1] !== null);
  const valid = p.validation.filter((point) => point[1] !== null);
  svg.dataset.points = String(train.length);
  svg.dataset.validation = String(valid.length);
  const children = [];
  const [w, h, left, right, top, bottom] = [720, 260, 48, 130, 14, 28];
  const all = [...train, ...valid];
  if (!all.length) {
    children.push(node("text", { x: w / 2 - 90, y: h / 2 }, "the loss appears here as it trains"));
    svg.replaceChildren(...children);
    return;
  }
  const maxStep = Math.max(p.total_steps || 0, ...all.map((q) => q[0]), 1);
  let low = Math.min(...all.map((q) => q[1])), high = Math.max(...all.map((q) => q[1]));
  if (high - low < 1e-6) { low -= 0.5; high += 0.5; }
  const x = (step) => left + (w - left - right) * step / maxStep;
  const y = (loss) => top + (h - top - bottom) * (high - loss) / (high - low);
  for (let i = 0; i <= 4; i++) {
    const value = low + (high - low) * i / 4;
    children.push(node("line", { x1: left, x2: w - right, y1: y(value), y2: y(value) }));
    children.push(node("text", { x: 4, y: y(value) + 4 }, value.toFixed(2)));
  }
  children.push(node("text", { x: left, y: h - 8 }, "step 0"));
  children.push(node("text", { x: w - right - 50, y: h - 8 }, "step " + maxStep));
  const line = (points, cls) => node("polyline", {
    class: cls, points: points.map((q) => x(q[0]) + "," + y(q[1])).join(" "),
  });
  children.push(line(train, "train"));
  if (valid.length) {
    children.push(line(valid, "valid"));
    for (const q of valid) children.push(node("circle", { cx: x(q[0]), cy: y(q[1]), r: 3 }));
  }
  for (const [cls, label, top] of [["train", "train loss", 24], ["valid", "validation loss", 44]]) { // the legend
    children.push(node("polyline", { class: cls, points: (w - right + 14) + "," + top + " " + (w - right + 34) + "," + top }));
    children.push(node("text", { x: w - right + 40, y: top + 4 }, label));
  }
  svg.replaceChildren(...children);
}

// 4. Compare

function fillCompareChoices() {
  if (!state || !run) return;
  const others = state.runs.filter((r) => r.final && "runs/" + r.name !== run)
    .map((r) => ["runs/" + r.name, "runs/" + r.name]);
  const keep = $("compare-other").value;
  options($("compare-other"), [["base", "the model before fine-tuning (base)"], ...others], keep || "base");
  const keepSheet = $("compare-sheet").value;
  options($("compare-sheet"), [["", "the held-out rows"], ...state.sheets.map((s) => [s, "sheets/" + s])], keepSheet || "");
}

async function runCompare() {
  $("compare-result").replaceChildren();
  try {
    const body = { run, other: $("compare-other").value, sheet: $("compare-sheet").value || null };
    await poll(await post("/api/compare", body), renderCompare);
  } catch (e) {
    setStatus("compare-status", e.message, "error");
  }
}

function renderCompare(job) {
  $("compare-cli").classList.remove("hidden");
  command("compare-command", job.command);
  $("compare-status").dataset.state = job.state;
  $("run-compare").disabled = job.state === "running";
  if (job.state === "running") {
    setStatus("compare-status",
              "both models are answering the rows of " + job.data + " … " + (job.log.slice(-1)[0] || ""));
    return;
  }
  if (job.state !== "done" || !job.result) {
    setStatus("compare-status", job.error || "the comparison failed", "error");
    return;
  }
  const c = job.result.compare, counts = c.counts;
  setStatus("compare-status", "tuned (" + job.target + ") against " + c.other + " on " + counts.rows + " rows of " +
            job.data + "; a row is right when " + c.decided_by.rule, "good");
  $("compare-files").replaceChildren(downloadLink(c.files.markdown), ", ", downloadLink(c.files.csv));
  const deltas = [];
  const row = (label, d, metric) => {
    const sign = metric === "loss" || metric === "mae" ? -1 : 1;
    const cls = d.delta === null ? "" : d.delta * sign > 0 ? "delta-up" : d.delta * sign < 0 ? "delta-down" : "";
    const number = (v) => (v === null || v === undefined ? "n/a" : Number.isInteger(v) ? String(v)
                                                                   : Math.abs(v) < 10 ? v.toFixed(3) : v.toFixed(1));
    deltas.push(el("tr", {}, el("td", {}, label), el("td", {}, number(d.other)), el("td", {}, number(d.run)),
                    el("td", { class: cls }, d.delta === null ? "n/a" : (d.delta > 0 ? "+" : "") + number(d.delta))));
  };
  for (const [metric, d] of Object.entries(c.deltas)) if (metric !== "fields") row(metric, d, metric);
  for (const [field, metrics] of Object.entries(c.deltas.fields || {})) {
    for (const [metric, d] of Object.entries(metrics)) row(field + ": " + metric, d, metric);
  }
  const table = el("table", { id: "compare-metrics" },
    el("tr", {}, el("th", {}, "metric"), el("th", {}, "base / other"), el("th", {}, "tuned"), el("th", {}, "change")),
    deltas);
  const summary = el("p", { id: "compare-counts" }, "right: tuned " + counts.right.run + " of " + counts.rows + ", other " +
    counts.right.other + "; right → wrong " + counts.right_to_wrong + ", wrong → right " + counts.wrong_to_right);
  const rows = job.result.rows.map((r) => el("tr", { class: "change-" + r.change.replace("->", "-") },
    el("td", {}, r.change === "same" ? "same" : r.change.replace("->", " → ")), el("td", {}, r.row),
    el("td", {}, r.question), el("td", {}, r.gold), el("td", {}, r["answer (run)"]), el("td", {}, r["answer (other)"])));
  const list = el("table", { id: "compare-rows" }, el("tr", {}, el("th", {}, "change"), el("th", {}, "row"),
    el("th", {}, "question"), el("th", {}, "gold"), el("th", {}, "tuned"), el("th", {}, "base / other")), rows);
  const more = job.result.rows_total > job.result.rows.length
    ? el("p", { class: "muted" }, "the first " + job.result.rows.length + " of " + job.result.rows_total +
         " rows; the csv has them all")
    : null;
  $("compare-result").replaceChildren(...[table, summary, el("h3", {}, "The rows, those that changed first"), list, more,
    el("button", { class: "next", onclick: () => show("try") }, "Next: try it")].filter((node) => node !== null));
}

// 5. Try and take

async function enterTry() {
  if (!run) return;
  fillAnswerSheets();
  command("try-command", "qatune serve " + run);
  $("try-cli").classList.remove("hidden");
  if (tried === run) return;
  setStatus("try-status", "loading " + run + "/final …");
  try {
    await post("/api/try", { run });
    tried = run;
    $("try-frame").src = "/try/";
    setStatus("try-status", "asking " + run + " (its final/ model), as qatune serve " + run + " would", "good");
    $("try-status").dataset.state = "loaded";
  } catch (e) {
    setStatus("try-status", e.message, "error");
  }
}

function fillAnswerSheets() {
  if (!state) return;
  const keep = $("answer-sheet").value || (state.project.sheet || "");
  options($("answer-sheet"), state.sheets.map((s) => [s, "sheets/" + s]), keep);
}

async function runAnswer() {
  try {
    await poll(await post("/api/answer", { run, sheet: $("answer-sheet").value }), renderAnswer);
  } catch (e) {
    setStatus("answer-status", e.message, "error");
  }
}

function renderAnswer(job) {
  command("answer-command", job.command);
  $("answer-status").dataset.state = job.state;
  $("answer-run").disabled = job.state === "running";
  if (job.state === "running") setStatus("answer-status", "answering every row …");
  else if (job.state === "done" && job.result) {
    setStatus("answer-status", "");
    $("answer-status").append("written: ", downloadLink(job.result, "download " + job.result));
  } else setStatus("answer-status", job.error || "failed", "error");
}

async function runExport() {
  try {
    await poll(await post("/api/export", { run, quant: $("quant").value }), renderExport);
  } catch (e) {
    setStatus("export-status", e.message, "error");
  }
}

function renderExport(job) {
  command("export-command", job.command);
  $("export-status").dataset.state = job.state;
  $("export-run").disabled = job.state === "running";
  const result = job.result || {};
  const check = result.check
    ? "check on " + result.check.rows + " rows of " + result.check.rows_from + ": " + result.check.line : "";
  if (job.state === "running") setStatus("export-status", "writing the file and checking it against the run …");
  else if (job.state === "done") {
    setStatus("export-status", check + "\n", "good");
    $("export-status").append(downloadLink(result.gguf), " and ", downloadLink(result.modelfile),
      el("div", { class: "muted" }, "then: ollama create NAME -f " + runName(result.modelfile)));
  } else setStatus("export-status", (check ? check + "\n" : "") + (job.error || "failed"), "error");
}

// --- start: back to where the server is

async function refreshState() {
  state = await api("/api/state");
  $("workspace").textContent = "workspace " + state.workspace;
  options($("sheet-list"), [["", "…"], ...state.sheets.map((s) => [s, s])], "");
  $("sheet-list-box").classList.toggle("hidden", !state.sheets.length);
  const runs = state.runs.map((r) => [r.name, "runs/" + r.name + " (" + (r.status || "?") + ")"]);
  options($("run-list"), [["", "…"], ...runs], "");
  $("run-list-box").classList.toggle("hidden", !state.runs.length);
  updateNav();
  return state;
}

async function restore() {
  try {
    await refreshState();
  } catch (e) {
    pageError(e.message);
    return;
  }
  pageError("");
  const project = state.project, jobs = state.jobs;
  if (project.described) renderSheet(project.described);
  if (project.written) { written = project.written; renderWritten(written); }
  run = project.run || (jobs.train ? jobs.train.target : null);
  if (jobs.check && written && jobs.check.target === written.config) poll(jobs.check, renderCheck);
  if (run) watchProgress();
  if (jobs.compare && jobs.compare.target === run) poll(await api("/api/jobs/" + jobs.compare.id), renderCompare);
  if (jobs.answer && jobs.answer.target === run) poll(jobs.answer, renderAnswer);
  if (jobs.export && jobs.export.target === run) poll(jobs.export, renderExport);
  const training = jobs.train && jobs.train.state === "running";
  updateNav();
  show(training ? "train" : sessionStorage.getItem("qatune-step") || (run ? "train" : written ? "check" : "sheet"));
}

for (const button of document.querySelectorAll("nav button")) {
  button.addEventListener("click", () => show(button.dataset.step));
}
for (const button of document.querySelectorAll("button[data-goto]")) {
  button.addEventListener("click", () => show(button.dataset.goto));
}
$("file").addEventListener("change", () => { if ($("file").files[0]) takeSheet($("file").files[0]); });
const drop = $("drop");
drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (event) => {
  event.preventDefault();
  drop.classList.remove("over");
  if (event.dataTransfer.files[0]) takeSheet(event.dataTransfer.files[0]);
});
$("sheet-list").addEventListener("change", () => { if ($("sheet-list").value) openSheet($("sheet-list").value); });
$("sheet-picker").addEventListener("change", () => openSheet(described.sheet, $("sheet-picker").value));
$("model").addEventListener("change", modelChanged);
$("run-list").addEventListener("change", async () => {
  if (!$("run-list").value) return;
  try {
    run = (await post("/api/runs/" + encodeURIComponent($("run-list").value) + "/open", {})).run;
    updateNav();
    watchProgress();
  } catch (e) {
    $("train-error").textContent = e.message;
  }
});
$("sheet-form").addEventListener("submit", writeConfig);
$("save-config").addEventListener("click", saveConfig);
$("run-check").addEventListener("click", runCheck);
$("train-start").addEventListener("click", () => startTraining("start"));
$("train-resume").addEventListener("click", () => startTraining("resume"));
$("train-again").addEventListener("click", () => startTraining("again"));
$("train-stop").addEventListener("click", stopTraining);
$("run-compare").addEventListener("click", runCompare);
$("answer-run").addEventListener("click", runAnswer);
$("answer-file").addEventListener("change", async () => {
  try {
    const saved = await uploadSheet($("answer-file").files[0], "answer");
    await refreshState();
    fillAnswerSheets();
    $("answer-sheet").value = saved.sheet;
  } catch (e) {
    setStatus("answer-status", e.message, "error");
  }
});
$("download-zip").addEventListener("click", (event) => {
  event.preventDefault();
  download("/api/runs/" + encodeURIComponent(runName(run)) + "/final.zip", runName(run) + "-final.zip")
    .catch((e) => pageError(e.message));
});
$("export-run").addEventListener("click", runExport);
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem("qatune-key", $("api-key").value);
  $("key-box").classList.add("hidden");
  restore();
});
restore();
