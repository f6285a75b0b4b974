// qatune ui: the page's script. Plain JavaScript, no build step, nothing loaded from elsewhere.
// Each step calls qatune ui's JSON API (/api/...) and shows the qatune command it ran. The server keeps what runs, so
// a page closed or reloaded, or another tab, asks it (/api/state, every STATE_MS) and shows the same: the training
// that runs, the workspace's runs, the config last written.
"use strict";

const $ = (id) => document.getElementById(id);
const STEPS = ["sheet", "check", "train", "compare", "try"];
const POLL_MS = 1000;
const STATE_MS = 2000;
let state = null; // GET /api/state
let described = null; // the sheet as /api/sheets describes it
let tasks = null; // the tasks and models offered for the chosen columns (described.tasks, then /tasks)
let written = null; // the config the Sheet step wrote
let run = null; // "runs/NAME": the run the later steps work on
let lastProgress = null; // the Train step's last /progress of `run`
let watching = null; // the run whose progress is being polled
let progressTimer = null;
let tried = null; // the run loaded behind /try
let starting = false; // a Start, Resume or Train-again request in flight
let comparing = false;
let taskAsk = 0; // the latest /tasks request: an older answer is dropped
let trainSeen = ""; // the training job and state the Train step last showed: its error is cleared when it changes
let syncing = null; // the interval that keeps this tab in step with the server

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
const query = (params) => "?" + Object.entries(params).filter(([, v]) => v !== null && v !== undefined && v !== "")
  .map(([k, v]) => k + "=" + encodeURIComponent(v)).join("&");

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

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const m = Math.floor(seconds / 60), s = Math.round(seconds % 60);
  return m ? m + " min " + s + " s" : s + " s";
}

// A command's bar of rows (validation, eval --compare, generate --file, export's check) as a <progress> and words.
function rowBar(id, bar, what) {
  const box = $(id);
  if (!bar) {
    box.classList.add("hidden");
    box.replaceChildren();
    delete box.dataset.done;
    return;
  }
  box.classList.remove("hidden");
  box.dataset.done = String(bar.done);
  box.dataset.total = String(bar.total);
  const left = bar.active ? (bar.remaining_s === null ? ", time left: working it out" : ", " +
    duration(bar.remaining_s) + " left") : "";
  box.replaceChildren(el("progress", { value: bar.done, max: Math.max(bar.total, 1) }),
                      el("span", {}, what + ": " + bar.done + " / " + bar.total + " rows" + left));
}

const runFacts = (path) => (state && path ? state.runs.find((r) => "runs/" + r.name === path) : null) || null;

// --- the steps

function show(step) {
  for (const name of STEPS) $("step-" + name).classList.toggle("hidden", name !== step);
  for (const button of document.querySelectorAll("nav button")) {
    button.classList.toggle("current", button.dataset.step === step);
  }
  sessionStorage.setItem("qatune-step", step);
  document.body.dataset.step = step;
  renderBanner();
  if (step === "compare") fillCompareChoices();
  if (step === "try") enterTry();
}

function updateNav() {
  const ready = { sheet: true, check: !!written, train: !!written || !!run, compare: !!run, try: !!run };
  for (const button of document.querySelectorAll("nav button")) button.disabled = !ready[button.dataset.step];
}

// The run the Train, Compare and Try steps work on: a new one (a config written, a run opened, the running training
// viewed) resets what they showed of the one before.
function setRun(next) {
  if (next === run) return;
  run = next;
  lastProgress = null;
  trainSeen = "";
  $("train-error").textContent = "";
  $("train-stats").replaceChildren();
  $("train-log").textContent = "";
  $("train-cli").classList.add("hidden");
  $("validation-table").classList.add("hidden");
  rowBar("validation-bar", null);
  drawCurve({ train: [], validation: [], total_steps: 0 });
  $("compare-result").replaceChildren();
  $("compare-cli").classList.add("hidden");
  setStatus("compare-status", "");
  delete $("compare-status").dataset.state;
  rowBar("compare-bar", null);
  setStatus("answer-status", "");
  delete $("answer-status").dataset.state;
  rowBar("answer-bar", null);
  setStatus("export-status", "");
  delete $("export-status").dataset.state;
  rowBar("export-bar", null);
  $("export-command").classList.add("hidden");
  $("ollama").classList.add("hidden");
  setStatus("zip-status", "");
  updateNav();
  if (run) watchProgress();
}

// The training that runs, on every step of every tab, with a way to view it.
function renderBanner() {
  const t = state && state.training;
  $("training-banner").classList.toggle("hidden", !t);
  document.body.dataset.training = t ? t.run : "";
  if (!t) return;
  let text = "A training is running: " + t.run + (t.stopping ? " (stopping: saving a checkpoint)" : "");
  if (t.step !== null) text += " · step " + t.step + " / " + t.total_steps;
  if (t.validating && t.validating.active) {
    text += " · validating: " + t.validating.done + " / " + t.validating.total + " rows";
  }
  $("training-text").textContent = text;
  const viewing = document.body.dataset.step === "train" && run === t.run;
  $("training-view").classList.toggle("hidden", viewing);
}

async function viewTraining() {
  const t = state && state.training;
  if (!t) return;
  try {
    await post("/api/runs/" + encodeURIComponent(runName(t.run)) + "/open", {});
  } catch (e) {
    pageError(e.message);
    return;
  }
  setRun(t.run);
  show("train");
}

// 1. Sheet

async function uploadSheet(file, purpose) {
  if (state && file.size > state.max_upload_bytes) {
    throw new Error(file.name + " is larger than the upload limit of " + Math.round(state.max_upload_bytes / 2 ** 20) +
                    " MB; start qatune ui with a larger --max-upload-mb");
  }
  return api("/api/sheets" + query({ name: file.name, purpose }), { method: "POST", body: file });
}

function uploadNote(upload) { // a file kept under another name, or the same file again: said, never silent
  if (upload.reused) {
    return "the same file as sheets/" + upload.sheet + " (already in the workspace): using it";
  }
  if (upload.renamed) {
    return "sheets/" + upload.uploaded_as.split(/[\\/]/).pop() + " holds another file: this one is saved as sheets/" +
      upload.sheet;
  }
  return "";
}

async function takeSheet(file) {
  $("sheet-error").textContent = "";
  $("sheet-form").classList.add("hidden");
  setStatus("sheet-status", "reading " + file.name + " …");
  try {
    const d = await uploadSheet(file);
    renderSheet(d);
    setStatus("sheet-status", uploadNote(d.upload));
    await refreshState();
  } catch (e) {
    setStatus("sheet-status", "");
    $("sheet-error").textContent = e.message;
    document.body.dataset.sheet = "error";
    refreshState().catch(() => {});
  }
}

// ``delimiter``: a separator chosen on the page; a sheet it cannot read keeps the form, to choose another.
async function openSheet(name, sheetName, delimiter) {
  $("sheet-error").textContent = "";
  try {
    const params = { sheet_name: sheetName, delimiter };
    renderSheet(await api("/api/sheets/" + encodeURIComponent(name) + query(params)));
  } catch (e) {
    if (!delimiter) $("sheet-form").classList.add("hidden");
    $("sheet-error").textContent = e.message;
    document.body.dataset.sheet = "error";
  }
}

// A select's options, redrawn only when they changed (a poll must not close a list the person has open).
function options(select, items, chosen) {
  const signature = JSON.stringify(items);
  const keep = select.value;
  if (select.dataset.items !== signature) {
    select.replaceChildren(...items.map(([value, label]) => el("option", { value }, label)));
    select.dataset.items = signature;
    select.value = keep;
  }
  if (chosen !== undefined && chosen !== null) select.value = chosen;
  if (select.selectedIndex < 0 && items.length) select.selectedIndex = 0;
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
  $("delimiter-box").classList.toggle("hidden", d.delimiter === null);
  if (d.delimiter !== null) $("delimiter").value = d.delimiter;
  $("delimiter-note").textContent = d.delimiter_note || "";
  const named = columns.map((c) => [c, c]);
  // No guess: nothing chosen, rather than the first column in two roles.
  const pick = (role) => (guess(role).column === null ? [["", "(choose a column)"], ...named] : named);
  options($("question"), pick("question"), guess("question").column || "");
  options($("answer"), pick("answer"), guess("answer").column || "");
  options($("context"), [["", "(none)"], ...named], guess("context").column || "");
  $("why-question").textContent = guess("question").reason;
  $("why-answer").textContent = guess("answer").reason;
  $("why-context").textContent = guess("context").reason;
  checkboxes($("answer-fields"), columns, "answers");
  checkboxes($("prompt-columns"), columns, "prompt");
  $("held-out").value = Math.round(d.held_out * 100);
  heldOutChanged();
  $("run-name").value = d.run;
  $("epochs").value = "";
  renderTasks(d.tasks, null, null);
  columnsChanged(false);
  $("sheet-form").classList.toggle("hidden", d.columns.length === 0);
  document.body.dataset.sheet = "read";
}

// The task row and the model row: the tasks the chosen columns allow, the recommended one first chosen.
function renderTasks(t, keepTask, keepModel) {
  tasks = t;
  const labels = t.tasks.map((x) => [x.value, x.label + (x.value === t.recommended && t.tasks.length > 1
                                                         ? " (recommended)" : "")]);
  const chosen = t.tasks.some((x) => x.value === keepTask) ? keepTask : t.recommended;
  options($("task"), labels, chosen);
  renderModels(keepModel);
}

function renderModels(keep) {
  const entry = tasks.tasks.find((x) => x.value === $("task").value) || tasks.tasks[0];
  const models = entry.models.map((m) => [m.value, m.label]);
  const values = entry.models.map((m) => m.value);
  options($("model"), [...models, ["__other__", "a hub id or a folder in the workspace …"]],
          keep && (values.includes(keep) || keep === "__other__") ? keep : entry.model || "__other__");
  const recommended = entry.value === tasks.recommended ? "recommended: " : "";
  const guess = tasks.tasks.length > 1 ? "; qatune init guesses " + tasks.guess + " for these columns" : "";
  $("why-task").textContent = tasks.reason + guess;
  $("why-model").textContent = entry.why ? recommended + entry.why : "installed models work offline";
  modelChanged();
}

function modelChanged() {
  const other = $("model").value === "__other__";
  $("model-other").classList.toggle("hidden", !other);
  $("why-epochs").textContent = "empty: " + ($("model").value === "scratch" ? "40 (a model from scratch needs many)"
                                                                              : "3, as qatune init writes");
}

function heldOutChanged() {
  const text = $("held-out").value.trim();
  const cell = $("why-held-out");
  cell.className = "";
  if (text === "") {
    cell.textContent = "type a share of the questions (10 is what qatune init holds out), or 0 to hold none out";
    cell.className = "warning";
  } else if (Number(text) === 0) {
    cell.textContent = "none held out: no validation scores after each epoch, and Compare needs a separate sheet " +
      "with the same columns";
    cell.className = "warning";
  } else {
    cell.textContent = "of the questions, scored after every epoch and compared in step 4";
  }
}

// The columns changed: one column in two roles is flagged, and the task and model lists are asked again.
function columnsChanged(ask = true) {
  const roles = [["question", $("question").value], ["answer", $("answer").value], ["context", $("context").value]];
  const clash = [];
  for (let i = 0; i < roles.length; i++) {
    for (let j = 0; j < i; j++) {
      if (roles[i][1] && roles[i][1] === roles[j][1]) clash.push(roles[j][0] + " and " + roles[i][0]);
    }
  }
  $("columns-warning").textContent = clash.length ? clash.join(", ") + " are the same column: choose another one" +
    (clash.some((c) => c === "question and answer") ? " (the model would learn to repeat the question)" : "") : "";
  if (ask) askTasks();
}

async function askTasks() {
  if (!described) return;
  const asked = ++taskAsk;
  document.body.dataset.tasks = "asking";
  const keepTask = $("task").value, keepModel = $("model").value;
  try {
    const t = await api("/api/sheets/" + encodeURIComponent(described.sheet) + "/tasks" + query({
      sheet_name: described.sheets.length ? $("sheet-picker").value : null, delimiter: chosenDelimiter(),
      question: $("question").value, answer: $("answer").value, context: $("context").value,
    }));
    if (asked !== taskAsk) return;
    renderTasks(t, keepTask, keepModel);
    $("sheet-error").textContent = "";
  } catch (e) {
    if (asked === taskAsk) $("sheet-error").textContent = e.message;
  } finally {
    if (asked === taskAsk) document.body.dataset.tasks = "ready";
  }
}

const chosenDelimiter = () => (described && described.delimiter !== null ? $("delimiter").value : null);

function checked(group) {
  return [...document.querySelectorAll(`input[data-group="${group}"]:checked`)].map((input) => input.value);
}

async function writeConfig(event) {
  event.preventDefault();
  $("sheet-error").textContent = "";
  const heldOut = $("held-out").value.trim();
  const problems = [];
  if (!$("question").value || !$("answer").value) problems.push("choose the question column and the answer column");
  if ($("columns-warning").textContent) problems.push($("columns-warning").textContent);
  if (heldOut === "") problems.push("held out is empty: type a share of the questions (10 is qatune init's), or 0");
  if (problems.length) {
    $("sheet-error").textContent = problems.join("\n");
    return;
  }
  const answers = [$("answer").value, ...checked("answers").filter((c) => c !== $("answer").value)];
  const choices = {
    sheet: described.sheet, sheet_name: described.sheets.length ? $("sheet-picker").value : null,
    delimiter: chosenDelimiter(), question: $("question").value, answers, context: $("context").value || null,
    task: $("task").value || null, prompt_columns: checked("prompt"), held_out: Number(heldOut) / 100,
    model: $("model").value === "__other__" ? $("model-other").value : $("model").value,
    epochs: $("epochs").value ? Number($("epochs").value) : null, run: $("run-name").value,
  };
  $("write-config").disabled = true;
  try {
    written = await post("/api/configs", choices);
    renderWritten(written);
    $("check-report").replaceChildren();
    $("check-cli").classList.add("hidden");
    setStatus("check-status", "");
    delete $("check-status").dataset.state;
    setRun(written.run); // Train shows this config's run, with its Start button
    await refreshState();
    updateTrainControls();
  } catch (e) {
    $("sheet-error").textContent = e.message;
  } finally {
    $("write-config").disabled = false;
  }
}

function renderWritten(w) {
  $("sheet-cli").classList.remove("hidden");
  command("sheet-command", w.command);
  $("sheet-changed").textContent = w.changed && w.changed.length ? "then, on the page: " + w.changed.join("; ") : "";
  $("sheet-notes").replaceChildren(...(w.notes || []).map((note) => el("li", {}, note)));
  $("sheet-config-link").replaceWith(Object.assign(downloadLink(w.config), { id: "sheet-config-link" }));
  for (const link of document.querySelectorAll(".config-link")) {
    link.replaceWith(Object.assign(downloadLink(w.config), { className: "config-link download" }));
  }
  $("config-yaml").value = w.yaml;
  $("config-yaml").dataset.config = w.config;
  updateNav();
}

async function saveConfig() {
  try {
    const saved = await api("/api/configs/" + written.config, {
      method: "PUT", body: JSON.stringify({ yaml: $("config-yaml").value }),
    });
    written.yaml = saved.yaml;
    setStatus("config-status", "saved; check it again", "good");
    await refreshState();
    updateTrainControls();
  } catch (e) {
    setStatus("config-status", e.message, "error");
  }
}

// 2. Check

async function runCheck() {
  $("run-check").disabled = true;
  try {
    await poll(await post("/api/check", { config: written.config }), renderCheck);
  } catch (e) {
    $("run-check").disabled = false;
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
  if (report.error) {
    setStatus("check-status", report.error, "error");
    $("check-report").replaceChildren();
  } else {
    setStatus("check-status", report.ok ? "fit to train" : "NOT fit to train: fix the errors below",
              report.ok ? "good" : "error");
    $("check-report").replaceChildren(...renderReport(report));
  }
  $("check-status").dataset.ok = report.ok ? "yes" : "no";
  if (report.ok) $("check-report").append(el("button", { class: "next", onclick: () => show("train") }, "Next: train"));
  refreshState().then(updateTrainControls).catch(() => {});
}

const rowList = (rows) => rows.slice(0, 10).join(", ") + (rows.length > 10 ? " and " + (rows.length - 10) + " more" : "");

function marked(text) { // ⟦trained tokens⟧ as <mark>
  return text.split(/(⟦[\s\S]*?⟧)/).map((part) => part.startsWith("⟦") ? el("mark", {}, part.slice(1, -1)) : part);
}

function about(seconds) {
  if (seconds < 90) return "about " + Math.max(1, Math.round(seconds)) + " seconds";
  if (seconds < 90 * 60) return "about " + Math.round(seconds / 60) + " minutes";
  return "about " + (seconds / 3600).toFixed(1) + " hours";
}

function renderReport(r) {
  const parts = [];
  const findings = r.findings || [];
  const errors = findings.filter((f) => f.level === "error");
  const warnings = findings.filter((f) => f.level === "warning");
  if (r.training_time && r.training_time.seconds !== null && r.training_time.seconds !== undefined) {
    parts.push(el("p", { id: "training-time" }, "training: " + about(r.training_time.seconds) + " on this machine (" +
                  r.training_time.basis + ")"));
  }
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
  // The set-ups this machine can run (one process per GPU, else per two cores), the configured one always.
  const setups = memory.setups.filter((s) => s.runnable !== false || s.setup === memory.configured);
  parts.push(el("h3", {}, "Memory (estimated peak per process; batch of " + memory.batch[0] + " rows × " +
                          memory.batch[1] + " tokens)"));
  parts.push(el("table", { id: "memory" }, el("tr", {}, el("th", {}, "set-up"), el("th", {}, "GiB"),
                                               el("th", {}, "of which"), el("th", {}, "")),
    setups.map((s) => el("tr", {}, el("td", {}, s.setup + (s.setup === memory.configured ? " (this config)" : "")),
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
  if (starting) return; // a double click sends one request
  starting = true;
  $("train-error").textContent = "";
  updateTrainControls();
  try {
    const job = await post("/api/train", how === "resume" ? { resume: run }
                                         : { config: written.config, overwrite: how === "again" });
    setRun(job.target);
    watchProgress();
  } catch (e) {
    $("train-error").textContent = e.message;
  } finally {
    starting = false;
    await refreshState().catch(() => {});
    updateTrainControls();
  }
}

async function stopTraining() {
  const job = lastProgress && lastProgress.job;
  if (!job) return;
  $("train-stop").disabled = true;
  try { await post("/api/jobs/" + job.id + "/stop", {}); } catch (e) { $("train-error").textContent = e.message; }
}

function watchProgress() {
  clearTimeout(progressTimer);
  const watched = run;
  watching = watched;
  const tick = async () => {
    if (run !== watched) return; // another run is shown now: its own watch runs
    let p;
    try {
      p = await api("/api/runs/" + encodeURIComponent(runName(watched)) + "/progress");
    } catch (e) {
      $("train-error").textContent = e.message;
      watching = null;
      return;
    }
    if (run !== watched) return;
    renderProgress(p);
    if (p.job && p.job.state === "running") progressTimer = setTimeout(tick, POLL_MS);
    else {
      watching = null;
      await refreshState().catch(() => {});
      updateTrainControls();
    }
  };
  tick();
}

function renderProgress(p) {
  lastProgress = p;
  const job = p.job;
  const running = job && job.state === "running";
  const seen = job ? job.id + ":" + job.state : "";
  if (seen !== trainSeen) { // the training changed (started, ended, stopped): an old refusal is not the news
    trainSeen = seen;
    $("train-error").textContent = "";
  }
  // run.json says running of a training that ended before it wrote its end (stopped while loading, killed)
  const recorded = job && !running && p.status === "running" ? job.state : p.status;
  const validating = running && p.validating && p.validating.active ? p.validating : null;
  const status = running ? (job.stopping ? "stopping: finishing the step, saving a checkpoint"
                                         : validating ? "validating" : "training")
                         : (recorded || (job ? job.state : "not started"));
  const left = running ? (p.remaining_s || 0) + (validating && validating.remaining_s ? validating.remaining_s : 0)
                       : null;
  const stat = (label, value, id) => el("div", { id }, el("span", {}, label), el("b", {}, value));
  $("train-stats").replaceChildren(
    stat("status", status, "stat-status"),
    stat("step", p.step + (p.total_steps ? " / " + p.total_steps : ""), "stat-step"),
    stat("epoch", (p.epoch || "–") + (p.epochs ? " / " + p.epochs : ""), "stat-epoch"),
    stat("tokens/s", p.tokens_per_s ? Math.round(p.tokens_per_s) : "–", "stat-tokens"),
    stat("elapsed", duration(job ? job.seconds : p.elapsed_s), "stat-elapsed"), // since its command started
    stat("time left", running && (p.remaining_s !== null || validating) ? duration(left) : "–", "stat-left"));
  // what it shows: the run's status, or how its command ended where it ended before writing one (stopped while loading)
  $("train-stats").dataset.status = running ? p.status || "running" : recorded || (job ? job.state : "");
  $("train-stats").dataset.step = String(p.step);
  $("train-stats").dataset.running = running ? "yes" : "no";
  rowBar("validation-bar", validating, "validating after epoch " + (p.epoch || 1) + " (the held-out rows)");
  drawCurve(p);
  renderValidation(p.evaluations || [], p.validation_columns || []);
  $("train-log").textContent = job ? job.log.join("\n") : "";
  $("train-log").scrollTop = $("train-log").scrollHeight;
  if (job && job.state === "failed" && job.error) $("train-error").textContent = job.error;
  $("train-cli").classList.toggle("hidden", !job);
  if (job) command("train-command", job.command);
  $("train-run").textContent = p.run;
  updateTrainControls();
}

// columns: the server's metric records (name, label, digits) of what validation reports, in their order.
function renderValidation(evaluations, columns) {
  const table = $("validation-table");
  table.classList.toggle("hidden", !evaluations.length);
  table.dataset.rows = String(evaluations.length);
  const number = (v, digits) => (v === null || v === undefined ? "–" : v.toFixed(digits));
  table.replaceChildren(
    el("tr", {}, el("th", {}, "validation after epoch"), el("th", {}, "step"),
       ...columns.map((c) => el("th", {}, c.label)), el("th", {}, "rows")),
    ...evaluations.map((e) => el("tr", {}, el("td", {}, e.epoch), el("td", {}, e.step),
                              ...columns.map((c) => el("td", {}, number(e[c.name], c.digits))),
                              el("td", {}, e.rows === null || e.rows === undefined ? "–" : e.rows))));
  table.parentElement.scrollTop = table.parentElement.scrollHeight; // the latest epoch in view
}

// Start, Stop, Resume, Train again and Next, from what the server says now: no refusal to meet after a click.
function updateTrainControls() {
  const p = lastProgress;
  const job = p && p.job;
  // running here: as its progress says, or as the state says (a training started a moment ago, from any tab)
  const running = !!(job && job.state === "running") || !!(state && state.training && state.training.run === run);
  const mine = !!(written && run === written.run);
  const trainable = state && state.trainable && written && state.trainable.config === written.config
    ? state.trainable : null;
  const other = state && state.training && state.training.run !== run ? state.training : null;
  const notStarted = !!p && !p.status && !running;
  $("train-start").classList.toggle("hidden", !(mine && notStarted));
  $("train-start").disabled = starting || !(trainable && trainable.ok);
  $("train-again").classList.toggle("hidden", !(p && mine && p.status && !running));
  $("train-again").disabled = starting || !!other || !(trainable && trainable.ok);
  $("train-resume").classList.toggle("hidden", !(p && !running && p.status === "stopped"));
  $("train-resume").disabled = starting || !!other;
  $("train-stop").disabled = !(job && job.state === "running") || job.stopping;
  let note = "";
  if (p && !running) {
    if (other) note = "a training is running (" + other.run + "); one at a time: this one can start once it ends";
    else if (mine && trainable && !trainable.ok && (notStarted || p.status)) note = trainable.why;
    else if (!mine && notStarted) note = run + " has not been trained: write its config on the Sheet step to train it";
  }
  $("train-note").textContent = note;
  const facts = runFacts(run); // (known once the state lists the run: its next step depends on it)
  const complete = !!p && p.status === "complete" && !running && !!facts;
  const next = $("train-next");
  next.classList.toggle("hidden", !complete);
  if (complete) {
    const others = comparableRuns(facts);
    if (facts && facts.base.ok) Object.assign(next, { textContent: "Next: compare with the base" }).dataset.goto = "compare";
    else if (others.length) Object.assign(next, { textContent: "Next: compare with another run" }).dataset.goto = "compare";
    else Object.assign(next, { textContent: "Next: try it" }).dataset.goto = "try";
  }
  renderBanner();
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

function renderRuns() {
  const runs = state ? state.runs : [];
  $("runs-box").classList.toggle("hidden", !runs.length);
  const open = (name) => async () => {
    try {
      setRun((await post("/api/runs/" + encodeURIComponent(name) + "/open", {})).run);
      show("train");
    } catch (e) {
      $("train-error").textContent = e.message;
    }
  };
  const rows = runs.map((r) => el("tr", { "data-run": r.name, class: "runs/" + r.name === run ? "current" : "" },
    el("td", {}, "runs/" + r.name), el("td", {}, r.status || "?"), el("td", {}, r.task || ""),
    el("td", {}, r.model || ""),
    el("td", {}, "runs/" + r.name === run ? "shown" : el("a", { href: "#", class: "link", onclick: (event) => {
      event.preventDefault();
      open(r.name)();
    } }, "open"))));
  const signature = JSON.stringify([runs, run]);
  if ($("runs").dataset.signature === signature) return;
  $("runs").dataset.signature = signature;
  $("runs").replaceChildren(el("tr", {}, el("th", {}, "run"), el("th", {}, "status"), el("th", {}, "task"),
                                   el("th", {}, "model"), el("th", {}, "")), ...rows);
}

// 4. Compare

// What makes two runs one kind of QA in their run summaries: only runs of this run's kind are offered to compare.
const KIND_FACTS = ["task"];
const sameKind = (a, b) => KIND_FACTS.every((fact) => a[fact] === b[fact]);

function comparableRuns(facts) {
  if (!state || !run) return [];
  return state.runs.filter((r) => r.final && "runs/" + r.name !== run && (!facts || sameKind(r, facts)));
}

function fillCompareChoices() {
  if (!state || !run) return;
  const facts = runFacts(run);
  const notes = [];
  const others = comparableRuns(facts).map((r) => ["runs/" + r.name, "runs/" + r.name]);
  const base = facts && facts.base.ok
    ? [["base", "the model before fine-tuning (base" + (facts.base.untrained_head ? ", its span head untrained)" : ")")]]
    : [];
  options($("compare-other"), [...base, ...others]);
  if (facts && !facts.base.ok) notes.push(facts.base.why);
  if (facts && facts.base.ok && facts.base.untrained_head) {
    notes.push("an extractive base is the pretrained encoder with its span head untrained: it points at answers by " +
               "chance and scores near zero, which is where fine-tuning starts from");
  }
  if (!base.length && !others.length) {
    notes.push("no other " + (facts ? facts.task + " " : "") + "run with a final model yet: train another one (other " +
               "settings, more epochs), then compare the two here");
  }
  const heldOut = !facts || facts.held_out;
  const sheets = state.sheets.map((s) => [s, "sheets/" + s]);
  options($("compare-sheet"), heldOut ? [["", "the held-out rows"], ...sheets] : sheets);
  if (!heldOut) {
    notes.push("this run held no rows out: compare on a sheet with the same columns that training did not see " +
               "(upload one here)");
  }
  $("compare-note").replaceChildren(...notes.map((n) => el("li", {}, n)));
  const running = $("compare-status").dataset.state === "running";
  $("run-compare").disabled = comparing || running || !$("compare-other").value ||
    (!heldOut && !$("compare-sheet").value);
}

async function runCompare() {
  if (comparing) return;
  comparing = true;
  $("run-compare").disabled = true;
  $("compare-result").replaceChildren();
  try {
    const body = { run, other: $("compare-other").value, sheet: $("compare-sheet").value || null };
    await poll(await post("/api/compare", body), renderCompare);
  } catch (e) {
    setStatus("compare-status", e.message, "error");
  } finally {
    comparing = false;
    fillCompareChoices();
  }
}

function compareProgress(job) {
  const other = job.command.includes("--compare base") ? "the base model" : job.command.split("--compare ")[1]
    .split(" ")[0];
  const bar = job.bar;
  if (!bar) {
    return ["both models answer the rows of " + job.data + ", one after the other (the tuned model first) … " +
            (job.log.slice(-1)[0] || ""), null, null];
  }
  const who = bar.bar <= 1 ? "the tuned model" : other;
  if (!bar.active) {
    return [bar.bar <= 1 ? "the tuned model has answered; " + other + " is loading …"
                         : "both models have answered; scoring and writing the comparison …", null, null];
  }
  return [who + " is answering the rows of " + job.data + (bar.bar <= 1 ? " (then " + other + ")" : ""), bar,
          who + " (" + bar.bar + " of 2)"];
}

function renderCompare(job) {
  $("compare-cli").classList.remove("hidden");
  command("compare-command", job.command);
  $("compare-status").dataset.state = job.state;
  $("run-compare").disabled = job.state === "running";
  if (job.state === "running") {
    const [text, bar, what] = compareProgress(job);
    setStatus("compare-status", text);
    rowBar("compare-bar", bar, what);
    return;
  }
  rowBar("compare-bar", null);
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
  const notes = (c.notes || []).length
    ? el("ul", { id: "compare-notes", class: "notes" }, c.notes.map((n) => el("li", {}, n))) : null;
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
  $("compare-result").replaceChildren(...[notes, table, summary, el("h3", {}, "The rows, those that changed first"),
    list, more, el("button", { class: "next", id: "compare-next", onclick: () => show("try") }, "Next: try it")]
    .filter((node) => node !== null));
}

// 5. Try and take

async function enterTry() {
  if (!run) return;
  fillAnswerSheets();
  command("try-command", "qatune serve " + run);
  $("try-cli").classList.remove("hidden");
  const facts = runFacts(run);
  const writes = !facts || facts.answer === "written"; // a GGUF file holds a model that writes its answers
  $("export-run").disabled = !writes || $("export-status").dataset.state === "running";
  $("export-note").textContent = writes ? "" : "a GGUF file holds a model that writes its answers; this " +
    facts.task + " run's model is the zip beside (a transformers folder)";
  zipSizes();
  if (tried === run) return;
  setStatus("try-status", "loading " + run + "/final …");
  delete $("try-status").dataset.state;
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

// The frame is as tall as serve's page inside it (same origin): an answer is never cut off at its bottom.
function fitFrame() {
  const frame = $("try-frame");
  if (!(frame.getAttribute("src") || "").startsWith("/try/")) return; // about:blank, before a model is loaded
  let doc;
  try { doc = frame.contentDocument; } catch (_) { return; }
  if (!doc || !doc.documentElement) return;
  const fit = () => {
    const height = Math.max(doc.documentElement.scrollHeight, doc.body ? doc.body.scrollHeight : 0);
    if (height) frame.style.height = (height + 2) + "px";
  };
  fit();
  const Observer = frame.contentWindow && frame.contentWindow.ResizeObserver;
  if (Observer && doc.body) new Observer(fit).observe(doc.body);
  if (frame.contentWindow && frame.contentWindow.MutationObserver && doc.body) {
    new frame.contentWindow.MutationObserver(fit).observe(doc.body, { childList: true, subtree: true,
                                                                      characterData: true, attributes: true });
  }
}

async function zipSizes() {
  try {
    const sizes = await api("/api/runs/" + encodeURIComponent(runName(run)) + "/final");
    const mb = (bytes) => (bytes / 2 ** 20 < 10 ? (bytes / 2 ** 20).toFixed(1) : Math.round(bytes / 2 ** 20)) + " MB";
    $("zip-dtype").options[0].textContent = "bf16 · " + mb(sizes.bf16);
    $("zip-dtype").options[1].textContent = "fp32, as trained · " + mb(sizes.fp32);
  } catch (_) { /* no final/ yet: the download says so */ }
}

function fillAnswerSheets() {
  if (!state) return;
  const keep = $("answer-sheet").value || (state.project.sheet || "");
  options($("answer-sheet"), state.sheets.map((s) => [s, "sheets/" + s]), keep);
}

async function runAnswer() {
  $("answer-run").disabled = true;
  try {
    await poll(await post("/api/answer", { run, sheet: $("answer-sheet").value }), renderAnswer);
  } catch (e) {
    $("answer-run").disabled = false;
    setStatus("answer-status", e.message, "error");
  }
}

function renderAnswer(job) {
  command("answer-command", job.command);
  $("answer-status").dataset.state = job.state;
  $("answer-run").disabled = job.state === "running";
  rowBar("answer-bar", job.state === "running" ? job.bar : null, "answering");
  if (job.state === "running") setStatus("answer-status", job.bar ? "" : "loading the model …");
  else if (job.state === "done" && job.result) {
    setStatus("answer-status", "");
    $("answer-status").append("written: ", downloadLink(job.result, "download " + job.result));
  } else setStatus("answer-status", job.error || "failed", "error");
}

async function runExport() {
  $("export-run").disabled = true;
  try {
    await poll(await post("/api/export", { run, quant: $("quant").value }), renderExport);
  } catch (e) {
    $("export-run").disabled = false;
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
  rowBar("export-bar", job.state === "running" ? job.bar : null, "checking the file against the run");
  $("ollama").classList.toggle("hidden", !(job.state === "done" && result.ollama));
  if (job.state === "running") {
    setStatus("export-status", job.bar ? "" : "writing the file, then checking it against the run …");
  } else if (job.state === "done") {
    setStatus("export-status", check + "\n", "good");
    $("export-status").append(downloadLink(result.gguf), " and ", downloadLink(result.modelfile));
    if (result.ollama) renderOllama(result.ollama);
  } else setStatus("export-status", (check ? check + "\n" : "") + (job.error || "failed"), "error");
}

function renderOllama(o) {
  $("ollama-how").textContent = o.passage
    ? "Put both files in one folder, then create the model. Its template reads the passage from the system " +
      "message and the question from the user's, as the run was trained: ask through Ollama's API (below, with a " +
      "held-out row), or in ollama run set the passage first with /set system \"…\"."
    : "Put both files in one folder, then create the model and ask it (below, with a held-out question).";
  $("ollama-usage").textContent = o.create + "\n" + o.ask;
  $("ollama").dataset.passage = o.passage ? "yes" : "no";
}

async function copyOllama() {
  const text = $("ollama-usage").textContent;
  try {
    await navigator.clipboard.writeText(text);
    $("ollama-copy").textContent = "Copied";
  } catch (_) { // no clipboard here: the text selected, for Ctrl-C
    const range = document.createRange();
    range.selectNodeContents($("ollama-usage"));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    $("ollama-copy").textContent = "Selected: press Ctrl-C";
  }
  setTimeout(() => { $("ollama-copy").textContent = "Copy"; }, 2500);
}

// --- start: back to where the server is, then kept in step with it

async function refreshState() {
  state = await api("/api/state" + query({ config: written ? written.config : null }));
  $("workspace").textContent = "workspace " + state.workspace;
  options($("sheet-list"), [["", "…"], ...state.sheets.map((s) => [s, s])], "");
  $("sheet-list-box").classList.toggle("hidden", !state.sheets.length);
  renderRuns();
  renderBanner();
  updateNav();
  return state;
}

async function syncState() {
  try {
    await refreshState();
  } catch (_) {
    return; // the server is gone or restarting: the next poll tries again
  }
  const t = state.jobs.train;
  if (run && t && t.target === run && t.state === "running" && watching !== run) watchProgress();
  updateTrainControls();
  if (document.body.dataset.step === "compare") fillCompareChoices();
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
  // A training that runs is what a new tab shows, whatever config was written last.
  setRun(state.training ? state.training.run : project.run || (jobs.train ? jobs.train.target : null));
  if (jobs.check && written && jobs.check.target === written.config) poll(jobs.check, renderCheck);
  if (jobs.compare && jobs.compare.target === run) poll(await api("/api/jobs/" + jobs.compare.id), renderCompare);
  if (jobs.answer && jobs.answer.target === run) poll(jobs.answer, renderAnswer);
  if (jobs.export && jobs.export.target === run) poll(jobs.export, renderExport);
  updateNav();
  const step = sessionStorage.getItem("qatune-step");
  show(state.training ? "train" : step && STEPS.includes(step) ? step : run ? "train" : written ? "check" : "sheet");
  if (syncing === null) syncing = setInterval(syncState, STATE_MS);
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
$("sheet-list").addEventListener("change", () => {
  if ($("sheet-list").value) {
    setStatus("sheet-status", "");
    openSheet($("sheet-list").value);
  }
});
$("sheet-picker").addEventListener("change", () => openSheet(described.sheet, $("sheet-picker").value,
                                                              chosenDelimiter()));
$("delimiter").addEventListener("change", () => openSheet(described.sheet, null, $("delimiter").value));
for (const id of ["question", "answer", "context"]) $(id).addEventListener("change", () => columnsChanged());
$("task").addEventListener("change", () => renderModels($("model").value));
$("model").addEventListener("change", modelChanged);
for (const kind of ["input", "change"]) $("held-out").addEventListener(kind, heldOutChanged);
$("sheet-form").addEventListener("submit", writeConfig);
$("save-config").addEventListener("click", saveConfig);
$("run-check").addEventListener("click", runCheck);
$("train-start").addEventListener("click", () => startTraining("start"));
$("train-resume").addEventListener("click", () => startTraining("resume"));
$("train-again").addEventListener("click", () => startTraining("again"));
$("train-stop").addEventListener("click", stopTraining);
$("train-next").addEventListener("click", () => show($("train-next").dataset.goto || "compare"));
$("training-view").addEventListener("click", viewTraining);
$("compare-other").addEventListener("change", fillCompareChoices);
$("compare-sheet").addEventListener("change", fillCompareChoices);
$("run-compare").addEventListener("click", runCompare);
$("compare-file").addEventListener("change", async () => {
  try {
    const saved = await uploadSheet($("compare-file").files[0], "answer");
    await refreshState();
    fillCompareChoices();
    $("compare-sheet").value = saved.sheet;
    setStatus("compare-status", uploadNote(saved));
    fillCompareChoices();
  } catch (e) {
    setStatus("compare-status", e.message, "error");
  }
});
$("answer-run").addEventListener("click", runAnswer);
$("answer-file").addEventListener("change", async () => {
  try {
    const saved = await uploadSheet($("answer-file").files[0], "answer");
    await refreshState();
    fillAnswerSheets();
    $("answer-sheet").value = saved.sheet;
    setStatus("answer-status", uploadNote(saved));
  } catch (e) {
    setStatus("answer-status", e.message, "error");
  }
});
$("download-zip").addEventListener("click", (event) => {
  event.preventDefault();
  const dtype = $("zip-dtype").value;
  setStatus("zip-status", "writing the zip" + (dtype === "bf16" ? " (its weights in bf16)" : "") + " …");
  download("/api/runs/" + encodeURIComponent(runName(run)) + "/final.zip?dtype=" + dtype, runName(run) + "-final.zip")
    .then(() => setStatus("zip-status", ""))
    .catch((e) => setStatus("zip-status", e.message, "error"));
});
$("try-frame").addEventListener("load", fitFrame);
$("export-run").addEventListener("click", runExport);
$("ollama-copy").addEventListener("click", copyOllama);
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem("qatune-key", $("api-key").value);
  $("key-box").classList.add("hidden");
  restore();
});
restore();
