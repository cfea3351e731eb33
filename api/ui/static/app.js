/* Kiln's browser UI: one script, no framework, no build step.
 *
 * Every piece of text that came from a user or the server (rows, names, messages) is put in the
 * page with textContent or as a text node, never parsed as HTML. The api token, when the server
 * needs one, lives in sessionStorage and travels as `Authorization: Bearer`; there is no cookie.
 */
"use strict";

const TOKEN_KEY = "kiln-api-token";
const PROFILE = "native_online_lora_v1";
const TERMINAL = new Set(["completed", "failed"]);
const POLL_MS = 1000;
const JOBS_POLL_MS = 2000;
const ETA_WINDOW = 20; // recent loss samples the ETA averages over

// ----- small DOM helpers ------------------------------------------------------------------------

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

/** An element with attributes and children; strings become text nodes (never HTML). */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

/** Give each body cell of a list table its column's name (`data-label`), which a phone shows
 * beside the value when the rows are laid out as cards; a visually hidden header (actions) gives
 * no label. */
function labelCells(table) {
  const names = [...table.tHead.rows[0].cells].map((th) => (th.querySelector(".sr") ? "" : th.textContent.trim()));
  for (const row of table.tBodies[0].rows) {
    [...row.cells].forEach((td, i) => {
      if (names[i]) td.dataset.label = names[i];
    });
  }
}

function setText(id, value) {
  const node = document.getElementById(id);
  if (node) node.textContent = value === null || value === undefined ? "" : String(value);
}

function pairs(entries) {
  const dl = el("dl", { class: "pairs" });
  for (const [key, value] of entries) {
    if (value === undefined) continue;
    dl.append(el("dt", { text: key }), el("dd", {}, value === null ? "–" : value));
  }
  return dl;
}

// ----- formatting -------------------------------------------------------------------------------

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(value >= 100 || unit === 0 ? 0 : value >= 10 ? 1 : 2)} ${units[unit]}`;
}

function fmtLoss(x) {
  return x === null || x === undefined ? "–" : Number(x).toFixed(4);
}

function fmtSeconds(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${s % 60}s`;
  const h = Math.floor(m / 60);
  return `${h}h ${m % 60}m`;
}

function fmtTime(ms) {
  return ms ? new Date(ms).toLocaleString() : "–";
}

function fmtMs(x) {
  return Number.isFinite(x) ? String(Math.round(x)) : "–";
}

function fmtNumber(x) {
  return x === null || x === undefined ? "–" : String(x);
}

// ----- the api ----------------------------------------------------------------------------------

class ApiFailure extends Error {
  constructor(status, error, headers) {
    super(error.message);
    this.status = status;
    this.code = error.code;
    this.hint = error.hint || "";
    this.headers = headers;
  }
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

/** One api call: JSON in (or a raw body), JSON out; errors are ApiFailure with the envelope. */
async function api(method, path, { json, raw, rawType, headers } = {}) {
  const sent = Object.assign({}, headers || {});
  const t = token();
  if (t) sent.Authorization = `Bearer ${t}`;
  let body;
  if (json !== undefined) {
    sent["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (raw !== undefined) {
    sent["Content-Type"] = rawType;
    body = raw;
  }
  let response;
  try {
    response = await fetch(path, { method, headers: sent, body, cache: "no-store", credentials: "omit" });
  } catch (err) {
    throw new ApiFailure(0, { code: "unreachable", message: `the Kiln api cannot be reached (${err.message})` });
  }
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch (_) {
    data = null;
  }
  if (!response.ok) {
    const error = data && data.error ? data.error : { code: `http_${response.status}`, message: text.slice(0, 300) };
    const failure = new ApiFailure(response.status, error, response.headers);
    if (response.status === 401) showLogin(failure.message);
    throw failure;
  }
  return { data, headers: response.headers, status: response.status };
}

async function get(path) {
  return (await api("GET", path)).data;
}

function randomKey() {
  const bytes = new Uint8Array(16);
  crypto.getRandomValues(bytes);
  return "ui-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function showGlobalError(message) {
  const banner = $("#global-error");
  banner.textContent = message;
  banner.hidden = !message;
}

/** An action's failure in the page banner: an ApiFailure as a sentence with a Retry button
 * that runs `retry`, anything else as its message. */
function showActionError(err, retry) {
  if (err instanceof ApiFailure) showProblem(err, retry);
  else showGlobalError(err.message);
}

// ----- sign-in ----------------------------------------------------------------------------------

function showLogin(message) {
  for (const page of $$(".page")) page.hidden = page.id !== "login";
  $("#auth-error").textContent = token() ? message || "" : "";
  stopPage();
  $("#auth-token").focus();
}

async function signIn(event) {
  event.preventDefault();
  const value = $("#auth-token").value.trim();
  if (!value) {
    $("#auth-error").textContent = "Enter a token.";
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, value);
  try {
    await get("/v1/config");
  } catch (err) {
    sessionStorage.removeItem(TOKEN_KEY);
    $("#auth-error").textContent = err.status === 401 ? "That token is not accepted by this server." : err.message;
    return;
  }
  $("#auth-token").value = "";
  $("#auth-error").textContent = "";
  $("#auth-signout").hidden = false;
  route();
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  $("#auth-signout").hidden = true;
  showLogin("");
}

// ----- pages and polling ------------------------------------------------------------------------

let generation = 0; // bumped on every navigation: a stale poll sees it changed and stops
const timers = new Set();

function stopPage() {
  generation += 1;
  for (const t of timers) clearTimeout(t);
  timers.clear();
}

/** Run `fn` now and then every `ms` while this page is shown. */
function poll(fn, ms) {
  const mine = generation;
  let failing = false;
  const tick = async () => {
    if (mine !== generation) return;
    let again = true;
    try {
      again = (await fn()) !== false;
      if (failing) showProblem(null); // answered again: the banner's problem is over
      failing = false;
    } catch (err) {
      if (err instanceof ApiFailure && err.status === 401) return;
      failing = true;
      showProblem(err, route);
      if (err instanceof ApiFailure && err.status >= 400 && err.status < 500) return; // a 404 (a deleted job): stop asking
    }
    if (again && mine === generation) {
      const t = setTimeout(tick, ms);
      timers.add(t);
    }
  };
  tick();
}

const PAGES = {
  overview: showOverview,
  train: showTrain,
  jobs: showJobs,
  job: showJob,
  inspect: showInspect,
  adapters: showAdapters,
};

function route() {
  stopPage();
  showGlobalError("");
  const hash = location.hash.replace(/^#\/?/, "");
  const [first, ...rest] = hash.split("/");
  let page = first || "overview";
  let arg = rest.length ? decodeURIComponent(rest.join("/")) : null;
  if (page === "jobs" && arg) page = "job";
  if (!PAGES[page]) page = "overview";
  for (const section of $$(".page")) section.hidden = section.id !== `page-${page}`;
  for (const link of $$("header nav a")) {
    const current = link.dataset.page === page || (page === "job" && link.dataset.page === "jobs");
    if (current) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  PAGES[page](arg).catch((err) => {
    if (!(err instanceof ApiFailure && err.status === 401)) showProblem(err, route);
  });
}

// ----- charts (uPlot) ---------------------------------------------------------------------------

const COLORS = ["#b4461b", "#1a5fb4", "#2e7d32", "#8e44ad"];
// Steps are whole numbers: ticks at 1, 2, 5, 10, 20, 50, ...
const STEP_INCREMENTS = Array.from({ length: 24 }, (_, i) => [1, 2, 5][i % 3] * 10 ** Math.floor(i / 3));

/** A loss chart in `container` with one line per entry of `lines`; returns the uPlot. */
function lossChart(container, lines) {
  clear(container);
  const size = () => ({ width: Math.max(260, container.clientWidth - 12), height: 280 });
  const opts = {
    ...size(),
    scales: { x: { time: false } },
    axes: [{ label: "step", incrs: STEP_INCREMENTS }, { label: "loss" }],
    series: [
      { label: "step" },
      ...lines.map((line, i) => ({
        label: line.label,
        stroke: line.color || COLORS[i % COLORS.length],
        width: line.width || 2,
        dash: line.dash,
        spanGaps: true,
        points: { show: line.points !== false, size: 4 },
      })),
    ],
  };
  const chart = new uPlot(opts, [[], ...lines.map(() => [])], container);
  new ResizeObserver(() => chart.setSize(size())).observe(container);
  return chart;
}

function setChartData(container, chart, data) {
  chart.setData(data);
  container.dataset.points = String(chart.data[0].length);
}

/** Train loss per step and each epoch's mean so far, from a job detail's loss_history. */
function lossSeries(history) {
  const steps = history.map((p) => p.step);
  const loss = history.map((p) => p.loss);
  const sums = new Map();
  for (const p of history) {
    const s = sums.get(p.epoch) || { total: 0, n: 0 };
    s.total += p.loss;
    s.n += 1;
    sums.set(p.epoch, s);
  }
  const mean = history.map((p) => sums.get(p.epoch).total / sums.get(p.epoch).n);
  return [steps, loss, mean];
}

// The job chart's lines: train loss per step, its running epoch mean, and the held-out
// validation loss at each evaluation (a point only where one was made).
const JOB_LINES = [
  { label: "train loss" },
  { label: "epoch mean", color: "#1a5fb4", dash: [6, 4], points: false },
  { label: "validation loss", color: "#2e7d32", width: 2 },
];

/** `lossSeries` with the validation curve overlaid: the x axis is the union of the train steps
 * and the evaluation steps (0 is the baseline); each line is null where it has no value. */
function jobSeries(detail) {
  const [steps, loss, mean] = lossSeries(detail.loss_history || []);
  const evaluations = detail.validation_history || [];
  const byStep = new Map(evaluations.map((e) => [e.global_step, e.loss]));
  const xs = Array.from(new Set([...steps, ...byStep.keys()])).sort((a, b) => a - b);
  const index = new Map(steps.map((s, i) => [s, i]));
  const at = (values, step) => (index.has(step) ? values[index.get(step)] : null);
  return [
    xs,
    xs.map((s) => at(loss, s)),
    xs.map((s) => at(mean, s)),
    xs.map((s) => (byStep.has(s) ? byStep.get(s) : null)),
  ];
}

/** Seconds left, from the measured time per step of the recent loss samples. */
function etaSeconds(detail) {
  if (detail.state !== "running") return null;
  const history = detail.loss_history || [];
  const remaining = detail.total_steps - detail.global_step;
  if (remaining <= 0 || history.length === 0) return null;
  const recent = history.slice(-ETA_WINDOW);
  const first = recent[0];
  const last = recent[recent.length - 1];
  let perStep;
  if (recent.length >= 2 && last.step > first.step) {
    perStep = (last.elapsed_secs - first.elapsed_secs) / (last.step - first.step);
  } else if (last.step > 0) {
    perStep = last.elapsed_secs / last.step;
  } else {
    return null;
  }
  return perStep * remaining;
}

// ----- the memory bar ---------------------------------------------------------------------------

const MEMORY_PARTS = [
  ["base_weights", "weights"],
  ["activations", "activations"],
  ["loss_workspace", "loss workspace"],
  ["lora_param_grad", "LoRA params+grads"],
  ["lora_optimizer_state", "optimizer state"],
  ["residency_scratch", "residency scratch"],
  ["safety_margin", "safety margin"],
];

/** The 413 message's breakdown (GB with two decimals), when no exact header came with it. */
function parseBreakdownMessage(message) {
  const gib = 1024 ** 3;
  const found = {};
  const names = { weights: "base_weights", activations: "activations", "loss workspace": "loss_workspace",
    "LoRA params+grads": "lora_param_grad", "optimizer state": "lora_optimizer_state", "residency scratch": "residency_scratch" };
  for (const [label, key] of Object.entries(names)) {
    const m = message.match(new RegExp(`${label.replace("+", "\\+")} ([0-9.]+) GB`));
    if (m) found[key] = Number(m[1]) * gib;
  }
  const total = message.match(/working set is ([0-9.]+) GB/);
  const available = message.match(/only ([0-9.]+) GB is available/);
  if (!total || !available) return null;
  return { ...found, total: Number(total[1]) * gib, available_bytes: Number(available[1]) * gib };
}

function stackedBar(parts, scale, label) {
  const bar = el("div", { class: "membar", role: "img", "aria-label": label });
  parts.forEach(([key, name, value], i) => {
    const seg = el("div", { class: `seg c${i}`, title: `${name}: ${fmtBytes(value)}`, dataset: { part: key } });
    seg.style.width = `${(100 * value) / scale}%`;
    bar.append(seg);
  });
  return bar;
}

/** The breakdown as stacked bars: against the budget (with its mark), and its own make-up. */
function memoryBar(breakdown, available) {
  const parts = MEMORY_PARTS.filter(([key]) => breakdown[key] !== undefined && breakdown[key] > 0).map(([key, label]) => [key, label, breakdown[key]]);
  const sum = parts.reduce((a, [, , v]) => a + v, 0);
  const total = breakdown.total || sum;
  const scale = Math.max(sum, available, total, 1);
  const budget = stackedBar(parts, scale, `memory estimate ${fmtBytes(total)} against a ${fmtBytes(available)} budget`);
  budget.classList.add("against-budget");
  const mark = el("div", { class: "budget", title: `budget ${fmtBytes(available)}` });
  mark.style.left = `${Math.min(100, (100 * available) / scale)}%`;
  budget.append(mark);
  const makeup = stackedBar(parts, Math.max(sum, 1), "what the estimate is made of");
  makeup.classList.add("makeup");
  const legend = el("ul", { class: "legend" });
  parts.forEach(([key, label, value], i) => {
    legend.append(el("li", { dataset: { part: key } }, el("span", { class: `swatch c${i}` }), `${label} ${fmtBytes(value)}`));
  });
  legend.append(el("li", {}, el("span", { class: "swatch budgetmark" }), `budget ${fmtBytes(available)}`));
  const fits = total <= available;
  const notes = [];
  if (breakdown.num_segments > 1) notes.push("With several checkpoint segments the activations and the loss workspace peak at different times; the estimate counts the larger.");
  if (breakdown.base_weights === 0) notes.push("The base model's weights are not in it: the worker already holds them, and the budget is what is left beside them.");
  return el("div", { class: "memory", dataset: { fits: String(fits) } },
    el("p", { class: "summary" }, `Memory estimate ${fmtBytes(total)} of ${fmtBytes(available)} available (${((100 * total) / Math.max(available, 1)).toFixed(1)}%) — ${fits ? "fits" : "does not fit"}`),
    el("p", { class: "note", text: "against the budget" }), budget,
    el("p", { class: "note", text: "made of" }), makeup,
    legend, notes.map((text) => el("p", { class: "note", text })));
}

function breakdownOf(failure) {
  const header = failure.headers && failure.headers.get("Kiln-Memory-Breakdown");
  if (header) {
    try {
      return JSON.parse(header);
    } catch (_) {
      /* fall back to the message */
    }
  }
  return parseBreakdownMessage(failure.message);
}

// ----- overview ---------------------------------------------------------------------------------

const OVERVIEW_VALUES = ["overview-runner", "overview-model", "overview-backend", "overview-memory", "overview-queue"];
const OVERVIEW_DETAILS = ["overview-runner-detail", "overview-device", "overview-route", "overview-memory-detail", "overview-queue-detail"];

async function showOverview() {
  poll(async () => {
    let health, config, queue;
    try {
      [health, config, queue] = await Promise.all([get("/health"), get("/v1/config"), get("/v1/train/queue")]);
    } catch (err) {
      showUnknown(OVERVIEW_VALUES, "unknown");
      showUnknown(OVERVIEW_DETAILS, "the api did not answer; this page asks again every 3 s");
      $("#overview-runner").className = "big dead";
      throw err;
    }
    const runner = health.runner;
    const runnerNode = $("#overview-runner");
    runnerNode.textContent = runner ? "alive" : "no live runner";
    runnerNode.className = `big ${runner ? "alive" : "dead"}`;
    setText("overview-runner-detail", runner
      ? `${runner.id} · ${runner.state} · heartbeat ${runner.heartbeat_age_s.toFixed(1)} s ago`
      : "Start a worker: kiln worker (or kiln up).");
    $("#guide-worker").closest("li").classList.toggle("done", Boolean(runner));
    const random = runner && runner.model_random_init;
    setText("overview-model", runner ? runner.model_path : config.model.path);
    setText("overview-model-random", random
      ? `A random ${random.preset} checkpoint: runs show the mechanics, not a useful model (kiln up --model-path DIR for a real Qwen3.5).` : "");
    setText("overview-device", runner ? `${runner.device} · weights ${runner.base_weight_dtype}` : `configured device ${config.model.device}`);
    setText("overview-backend", runner ? runner.backend : "–");
    setText("overview-route", runner ? `loss route ${runner.loss_route}` : "");
    const memory = config.memory || {};
    setText("overview-memory", runner && runner.free_memory_bytes !== null
      ? `${fmtBytes(runner.free_memory_bytes)} free of ${fmtBytes(runner.total_memory_bytes)}` : "–");
    setText("overview-memory-detail", (memory.reserve_gb === undefined ? "" : `reserve ${memory.reserve_gb} GiB`) +
      (memory.training_memory_gb ? ` · training capped at ${memory.training_memory_gb} GiB` : ""));
    setText("overview-queue", `${health.queue_depth} queued`);
    setText("overview-queue-detail", `${queue.running_jobs.length} running · ${queue.completed.length} finished`);
  }, 3000);
}

// ----- train ------------------------------------------------------------------------------------

let defaults = null;
let formKey = randomKey();
let pendingPrefill = null;
// The held-out rows of the job a resume continues (a file input cannot be prefilled).
let resumeValidation = null;
let sampleRows = null;
// Alpha follows the rank (alpha = 2 × rank) until the person types an alpha of their own.
let alphaChosen = false;

const FIELD_IDS = {
  output_name: "sft-output-name",
  epochs: "sft-epochs",
  lora_rank: "sft-lora-rank",
  lora_alpha: "sft-lora-alpha",
  allow_high_lora_scale: "sft-lora-alpha",
  optimizer: "sft-optimizer",
  learning_rate: "sft-learning-rate",
  seed: "sft-seed",
  invalid_row_policy: "sft-invalid-row-policy",
  detect_anomaly: "sft-detect-anomaly",
  adapter_smoke_test: "sft-adapter-smoke-test",
  adapter_smoke_prompts: "sft-adapter-smoke-prompts",
  checkpoint_interval: "sft-checkpoint-interval",
  resume_checkpoint: "sft-resume-checkpoint",
  base_adapter: "sft-base-adapter",
  grad_checkpoint_segments: "sft-grad-checkpoint-segments",
};
// `validation.<field>` in a server message -> the form field.
const VALIDATION_FIELD_IDS = {
  examples: "sft-validation-file",
  dataset_path: "sft-validation-file",
  holdout_percent: "sft-holdout-percent",
  interval_steps: "sft-validation-interval",
};
const SOURCE_FIELD = { file: "sft-dataset-file", text: "sft-dataset-text", stored: "sft-dataset-select", sample: "sft-dataset-text", "sample-instruction": "sft-dataset-text" };

function source() {
  return $("input[name='sft-source']:checked").value;
}

function setSource(value) {
  $(`#sft-source-${value}`).checked = true;
  for (const node of $$("#sft-form [data-source]")) node.classList.toggle("active", node.dataset.source === value);
}

/** The id prefix of an optimizer's own fields: `sft-adamw-` for adam_w. */
function optimizerPrefix(kind) {
  return `sft-${kind.replace(/_/g, "")}-`;
}

/** The optimizer choices and each kind's own fields, from the server's registry (defaults.json). */
function buildOptimizerForms() {
  const anchor = $("#sft-advanced");
  for (const kind of defaults.optimizer_kinds) {
    $("#sft-optimizer").append(el("option", { value: kind, text: kind }));
    const fields = defaults.optimizer_fields[kind];
    const title = defaults.optimizer_titles[kind];
    if (!fields.length) {
      anchor.before(el("p", { class: "note optimizer-fields", dataset: { optimizer: kind } }, `${title} has no fields of its own.`));
      continue;
    }
    const rows = fields.map(({ name, type }) => {
      const id = optimizerPrefix(kind) + name.replace(/_/g, "-");
      const error = el("p", { id: `${id}-error`, class: "field-error", role: "alert" });
      if (type === "boolean") {
        const box = el("input", { id, type: "checkbox", dataset: { key: name } });
        return el("div", { class: "field check" }, el("label", {}, box, ` ${name}`), error);
      }
      const input = type === "integer"
        ? el("input", { id, type: "number", dataset: { key: name, int: "1" } })
        : el("input", { id, type: "text", inputmode: "decimal", spellcheck: "false", dataset: { key: name } });
      return el("div", { class: "field" }, el("label", { for: id }, name), input, error);
    });
    anchor.before(el("fieldset", { class: "group grid optimizer-fields", id: `sft-opt-${kind}`, dataset: { optimizer: kind } },
      el("legend", {}, title), rows));
  }
}

function showOptimizerFields() {
  const kind = $("#sft-optimizer").value;
  for (const node of $$(".optimizer-fields")) node.hidden = node.dataset.optimizer !== kind;
  setText("sft-learning-rate-kind", kind);
  setText("sft-learning-rate-default", defaults ? String(defaults.learning_rate[kind]) : "the server's");
  $("#sft-learning-rate").placeholder = defaults ? `blank: ${defaults.learning_rate[kind]}` : "";
}

function applyDefaults() {
  const c = defaults.config;
  buildOptimizerForms();
  $("#sft-epochs").value = c.epochs;
  $("#sft-lora-rank").value = c.lora_rank;
  $("#sft-lora-alpha").value = c.lora_alpha;
  $("#sft-optimizer").value = c.optimizer.kind;
  $("#sft-invalid-row-policy").value = c.invalid_row_policy;
  $("#sft-detect-anomaly").checked = c.detect_anomaly;
  $("#sft-adapter-smoke-test").checked = c.adapter_smoke_test;
  $("#sft-allow-high-lora-scale").checked = c.allow_high_lora_scale;
  setText("sft-max-lora-scale", String(defaults.max_lora_alpha_over_rank));
  alphaChosen = c.lora_alpha !== ALPHA_PER_RANK * c.lora_rank;
  demoNote();
  for (const kind of defaults.optimizer_kinds) {
    for (const input of $$(`[data-optimizer='${kind}'] [data-key]`)) {
      const value = defaults.optimizers[kind][input.dataset.key];
      if (input.type === "checkbox") input.checked = Boolean(value);
      else input.value = String(value);
    }
  }
  $("#sft-adapter-smoke-prompts").placeholder = defaults.builtin_smoke_prompts.join("\n");
  syncSmokePrompts();
  showOptimizerFields();
}

const ALPHA_PER_RANK = 2;

/** A new rank carries alpha along (2 × rank) unless alpha was chosen by hand. */
function followRank() {
  const rank = Number($("#sft-lora-rank").value);
  if (!alphaChosen && Number.isInteger(rank) && rank > 0) $("#sft-lora-alpha").value = String(ALPHA_PER_RANK * rank);
}

/** How the demo's run differs from the server's defaults the form starts from, in words. */
function demoDifferences() {
  const demo = defaults.demo;
  const c = defaults.config;
  const lr = defaults.learning_rate;
  const out = [];
  if (demo.optimizer !== c.optimizer.kind) out.push(`optimizer ${demo.optimizer} (the server's default is ${c.optimizer.kind})`);
  if (demo.learning_rate !== lr[demo.optimizer]) out.push(`learning rate ${demo.learning_rate} (the ${demo.optimizer} default is ${lr[demo.optimizer]})`);
  if (demo.epochs !== c.epochs) out.push(`${demo.epochs} epochs (default ${c.epochs})`);
  if (demo.lora_rank !== c.lora_rank || demo.lora_alpha !== c.lora_alpha) out.push(`rank ${demo.lora_rank} / alpha ${demo.lora_alpha}`);
  out.push(`seed ${demo.seed}`);
  return out;
}

function demoNote() {
  const node = $("#sft-demo-note");
  if (!defaults.demo) {
    node.hidden = true;
    return;
  }
  node.hidden = false;
  setText("sft-demo-differences", demoDifferences().join(", "));
}

/** Fill the form with the demo's settings (its data is the sample). */
function useDemoSettings() {
  const demo = defaults.demo;
  $("#sft-epochs").value = String(demo.epochs);
  $("#sft-lora-rank").value = String(demo.lora_rank);
  $("#sft-lora-alpha").value = String(demo.lora_alpha);
  alphaChosen = demo.lora_alpha !== ALPHA_PER_RANK * demo.lora_rank;
  $("#sft-optimizer").value = demo.optimizer;
  showOptimizerFields();
  $("#sft-learning-rate").value = String(demo.learning_rate);
  $("#sft-seed").value = String(demo.seed);
  setSource("sample");
  formKey = randomKey();
}

function syncSmokePrompts() {
  $("#sft-adapter-smoke-prompts").disabled = !$("#sft-adapter-smoke-test").checked;
}

function fillSelect(select, options, placeholder) {
  const keep = select.value;
  clear(select);
  select.append(el("option", { value: "", text: placeholder }));
  for (const option of options) {
    if (option.group) {
      const group = el("optgroup", { label: option.group });
      for (const inner of option.options) group.append(el("option", { value: inner.value, text: inner.label }));
      select.append(group);
    } else {
      select.append(el("option", { value: option.value, text: option.label }));
    }
  }
  if ($$("option", select).some((o) => o.value === keep)) select.value = keep;
}

async function loadChoices() {
  const [datasets, adapters, checkpoints] = await Promise.all([
    get("/v1/datasets"),
    get("/v1/adapters"),
    get("/v1/checkpoints"),
  ]);
  const datasetOptions = datasets.datasets.map((d) => ({
    value: d.dataset_path,
    label: d.stats ? `${d.name} (${d.stats.rows_kept} rows)` : d.name,
  }));
  fillSelect($("#sft-dataset-select"), datasetOptions, datasetOptions.length ? "— choose —" : "— none stored yet —");
  fillSelect($("#sft-base-adapter"), adapters.adapters.map((a) => ({ value: a.name, label: `${a.name} (rank ${a.rank})` })), "— none —");
  const byAdapter = new Map();
  for (const c of checkpoints.checkpoints) {
    if (!byAdapter.has(c.adapter_name)) byAdapter.set(c.adapter_name, []);
    const summary = c.summary;
    const label = summary ? `step ${summary.global_step}/${summary.total_steps}${summary.complete ? " (complete)" : ""}` : `step ${c.global_step} (unreadable)`;
    byAdapter.get(c.adapter_name).push({ value: c.resume_checkpoint, label });
  }
  const wanted = $("#sft-output-name").value.trim();
  const groups = [...byAdapter.entries()]
    .filter(([name]) => !wanted || name === wanted)
    .map(([name, options]) => ({ group: name, options }));
  fillSelect($("#sft-resume-checkpoint"), groups, "— start fresh —");
  return datasets;
}

let trainWired = false;

async function showTrain() {
  if (!defaults) {
    defaults = await get("/ui/defaults.json");
    applyDefaults();
  }
  if (!trainWired) wireTrain();
  setSource(source());
  await loadChoices();
  if (pendingPrefill) {
    applyPrefill(pendingPrefill);
    pendingPrefill = null;
  }
}

function wireTrain() {
  trainWired = true;
  const form = $("#sft-form");
  form.addEventListener("input", () => {
    formKey = randomKey(); // a changed request is a new submission; an unchanged one replays
  });
  form.addEventListener("change", () => {
    formKey = randomKey();
  });
  for (const radio of $$("input[name='sft-source']")) radio.addEventListener("change", () => setSource(radio.value));
  $("#sft-dataset-file").addEventListener("change", () => {
    setSource("file");
    const file = $("#sft-dataset-file").files[0];
    if (file && !$("#sft-dataset-name").value) $("#sft-dataset-name").value = file.name.replace(/[^A-Za-z0-9._-]/g, "-");
  });
  $("#sft-dataset-text").addEventListener("input", () => setSource("text"));
  $("#sft-dataset-select").addEventListener("change", () => setSource("stored"));
  $("#sft-optimizer").addEventListener("change", showOptimizerFields);
  $("#sft-lora-alpha").addEventListener("input", () => {
    alphaChosen = true;
  });
  $("#sft-lora-rank").addEventListener("input", followRank);
  $("#sft-demo-settings").addEventListener("click", useDemoSettings);
  $("#sft-adapter-smoke-test").addEventListener("change", syncSmokePrompts);
  $("#sft-output-name").addEventListener("change", () => loadChoices().catch(() => {}));
  $("#sft-dataset-upload").addEventListener("click", uploadDataset);
  $("#sft-preflight").addEventListener("click", () => runPreflight());
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    submitJob();
  });
}

class InputProblem extends Error {
  constructor(field, message) {
    super(message);
    this.field = field;
  }
}

/** JSON Lines text as objects, naming the line of anything that is not a JSON object. */
function parseJsonl(text, field) {
  const rows = [];
  const bad = [];
  text.split("\n").forEach((line, i) => {
    const trimmed = line.trim();
    if (!trimmed) return;
    try {
      const value = JSON.parse(trimmed);
      if (value === null || typeof value !== "object" || Array.isArray(value)) bad.push(`line ${i + 1}: not a JSON object`);
      else rows.push(value);
    } catch (err) {
      bad.push(`line ${i + 1}: not valid JSON (${err.message})`);
    }
  });
  if (bad.length) {
    const shown = bad.slice(0, 5).join("; ") + (bad.length > 5 ? `; and ${bad.length - 5} more` : "");
    throw new InputProblem(field, `${shown}. Rows sent with the form must be JSON objects; upload the file as a dataset to let the skip policy record such lines.`);
  }
  if (!rows.length) throw new InputProblem(field, "no rows: the data is empty or only blank lines");
  return rows;
}

/** Pasted text: a JSON array of rows, one row object, or JSON Lines. */
function parsePasted(text, field) {
  const trimmed = text.trim();
  if (!trimmed) throw new InputProblem(field, "paste at least one row");
  try {
    const whole = JSON.parse(trimmed);
    if (Array.isArray(whole)) {
      if (!whole.length) throw new InputProblem(field, "the array holds no rows");
      return whole;
    }
    if (whole && typeof whole === "object") return [whole];
  } catch (err) {
    if (err instanceof InputProblem) throw err;
  }
  return parseJsonl(trimmed, field);
}

async function sampleText(file = "sample.jsonl") {
  if (sampleRows === null) sampleRows = {};
  if (sampleRows[file] === undefined) {
    let response;
    try {
      response = await fetch(`/ui/${file}`, { cache: "no-store" });
    } catch (err) {
      throw new ApiFailure(0, { code: "unreachable", message: `the Kiln api cannot be reached (${err.message})` });
    }
    if (!response.ok) throw new ApiFailure(response.status, { code: `http_${response.status}`, message: "the sample rows could not be loaded" });
    sampleRows[file] = await response.text();
  }
  return sampleRows[file];
}

/** The request's data transport from the chosen source. */
async function dataTransport() {
  switch (source()) {
    case "file": {
      const file = $("#sft-dataset-file").files[0];
      if (!file) throw new InputProblem("sft-dataset-file", "choose a JSONL file");
      return { examples: parseJsonl(await file.text(), "sft-dataset-file") };
    }
    case "text":
      return { examples: parsePasted($("#sft-dataset-text").value, "sft-dataset-text") };
    case "stored": {
      const path = $("#sft-dataset-select").value;
      if (!path) throw new InputProblem("sft-dataset-select", "choose a stored dataset");
      return { dataset_path: path };
    }
    case "sample-instruction":
      return { examples: parseJsonl(await sampleText("sample-instruction.jsonl"), "sft-dataset-text") };
    default:
      return { examples: parseJsonl(await sampleText(), "sft-dataset-text") };
  }
}

/** A typed value for a field: numbers when they are numbers, the text itself otherwise (the
 * server then names the field and says what it wanted). */
function numberOf(raw, integer) {
  const text = raw.trim();
  if (integer && /^-?[0-9]+$/.test(text)) return Number(text);
  if (!integer && text !== "" && Number.isFinite(Number(text))) return Number(text);
  return text;
}

function optional(config, key, id, integer) {
  const raw = $(`#${id}`).value;
  if (raw.trim() !== "") config[key] = numberOf(raw, integer);
}

async function buildRequest() {
  const body = await dataTransport();
  const config = { training_profile: PROFILE };
  const name = $("#sft-output-name").value.trim();
  if (name) config.output_name = name;
  optional(config, "epochs", "sft-epochs", true);
  optional(config, "lora_rank", "sft-lora-rank", true);
  optional(config, "lora_alpha", "sft-lora-alpha", false);
  const kind = $("#sft-optimizer").value;
  const optimizer = { kind };
  for (const input of $$(`[data-optimizer='${kind}'] [data-key]`)) {
    if (input.type === "checkbox") optimizer[input.dataset.key] = input.checked;
    else if (input.value.trim() !== "") optimizer[input.dataset.key] = numberOf(input.value, Boolean(input.dataset.int));
  }
  config.optimizer = optimizer;
  optional(config, "learning_rate", "sft-learning-rate", false);
  const seed = $("#sft-seed").value.trim();
  if (seed) config.seed = /^[0-9]+$/.test(seed) ? seed : numberOf(seed, true);
  config.invalid_row_policy = $("#sft-invalid-row-policy").value;
  if ($("#sft-detect-anomaly").checked) config.detect_anomaly = true;
  if ($("#sft-allow-high-lora-scale").checked) config.allow_high_lora_scale = true;
  if ($("#sft-adapter-smoke-test").checked) {
    config.adapter_smoke_test = true;
    const prompts = $("#sft-adapter-smoke-prompts").value.split("\n").map((p) => p.trim()).filter(Boolean);
    if (prompts.length) config.adapter_smoke_prompts = prompts;
  }
  optional(config, "checkpoint_interval", "sft-checkpoint-interval", true);
  const resume = $("#sft-resume-checkpoint").value;
  if (resume) config.resume_checkpoint = resume;
  const base = $("#sft-base-adapter").value;
  if (base) config.base_adapter = base;
  optional(config, "grad_checkpoint_segments", "sft-grad-checkpoint-segments", true);
  body.config = config;
  const validation = await validationRequest();
  if (validation) body.validation = validation;
  return body;
}

/** The request's `validation`: a held-out file's rows or a holdout percent, and the interval. */
async function validationRequest() {
  const file = $("#sft-validation-file").files[0];
  const percent = $("#sft-holdout-percent").value.trim();
  const interval = $("#sft-validation-interval").value.trim();
  if (file && percent) throw new InputProblem("sft-holdout-percent", "choose a validation file or a holdout percent, not both");
  let validation = null;
  if (file) validation = { examples: parseJsonl(await file.text(), "sft-validation-file") };
  else if (percent) validation = { holdout_percent: numberOf(percent, true) };
  else if (resumeValidation && $("#sft-resume-checkpoint").value) validation = { ...resumeValidation };
  if (interval) {
    if (!validation) throw new InputProblem("sft-validation-interval", "choose a validation file or a holdout percent first");
    validation.interval_steps = numberOf(interval, true);
  }
  return validation;
}

function clearFieldErrors() {
  for (const node of $$("#sft-form .field-error")) node.textContent = "";
  for (const node of $$("#sft-form [aria-invalid]")) node.removeAttribute("aria-invalid");
  const banner = $("#sft-error");
  clear(banner);
  banner.hidden = true;
}

function markField(id, message) {
  const input = document.getElementById(id);
  const slot = document.getElementById(`${id}-error`);
  if (!input || !slot) return false;
  slot.textContent = message;
  input.setAttribute("aria-invalid", "true");
  const advanced = input.closest("details");
  if (advanced) advanced.open = true;
  return true;
}

/** Which form field a 400 message names, or null. */
function fieldOfMessage(message) {
  const validation = message.match(/validation\.([a-z_]+)/);
  if (validation && VALIDATION_FIELD_IDS[validation[1]]) return VALIDATION_FIELD_IDS[validation[1]];
  if (/SFT validation row \d+|validation corpus|^validation:/.test(message)) return "sft-validation-file";
  const opt = message.match(/config\.optimizer\.([a-z_0-9]+)\.([a-z_0-9]+)/);
  if (opt && document.getElementById(optimizerPrefix(opt[1]) + opt[2].replace(/_/g, "-"))) {
    return optimizerPrefix(opt[1]) + opt[2].replace(/_/g, "-");
  }
  const named = message.match(/config\.([a-z_]+)/);
  if (named && FIELD_IDS[named[1]]) return FIELD_IDS[named[1]];
  if (/SFT row \d+|examples(\[\d+\])?|SFT corpus|dataset_path|no trainable rows/.test(message)) return SOURCE_FIELD[source()];
  let best = null;
  for (const [key, id] of Object.entries(FIELD_IDS)) {
    const m = message.match(new RegExp(`\\b${key}\\b`));
    if (m && (best === null || m.index < best.index)) best = { index: m.index, id };
  }
  return best ? best.id : null;
}

function showFailure(err, target, retry) {
  const banner = $("#sft-error");
  if (err instanceof InputProblem) {
    markField(err.field, err.message);
    return;
  }
  if (err.status === 413 && err.code === "training_will_not_fit") {
    const breakdown = breakdownOf(err);
    const box = target || banner;
    clear(box);
    box.append(el("h2", { text: "Will not fit (413)" }), el("p", { text: err.message }));
    if (breakdown) box.append(memoryBar(breakdown, breakdown.available_bytes));
    box.hidden = false;
    box.dataset.status = "413";
    return;
  }
  const field = err.status === 400 ? fieldOfMessage(err.message) : null;
  if (field && markField(field, err.message)) {
    document.getElementById(field).focus();
  }
  if (err instanceof ApiFailure && (isUnreachable(err) || err.status >= 500)) {
    banner.append(...problemNodes(err, retry));
    banner.dataset.status = String(err.status || 0);
    banner.hidden = false;
    return;
  }
  banner.append(
    el("strong", { text: `${err.code || "error"}${err.status ? ` (HTTP ${err.status})` : ""}: ` }),
    err.message || String(err),
  );
  if (err.hint) banner.append(el("p", { class: "note", text: err.hint }));
  banner.dataset.status = String(err.status || "");
  banner.hidden = false;
}

async function runPreflight() {
  clearFieldErrors();
  const result = $("#preflight-result");
  clear(result);
  delete result.dataset.status;
  const button = $("#sft-preflight");
  button.disabled = true;
  try {
    const body = await buildRequest();
    const { data } = await api("POST", "/v1/train/sft/preflight", { json: body });
    renderPreflight(result, data);
  } catch (err) {
    if (err instanceof ApiFailure && err.status === 413) showFailure(err, result);
    else showFailure(err, null, runPreflight);
  } finally {
    button.disabled = false;
  }
}

// Why a dataset's sha256 and a run's kept-corpus sha256 never match.
const KEPT_CORPUS_NOTE = "The SHA-256 of the kept rows' own hashes, in order: it names exactly what trains, "
  + "so it differs from a stored dataset's sha256, which is of the file's bytes.";

function renderPreflight(box, plan) {
  box.dataset.status = "200";
  const drawn = new Set(plan.drawn);
  box.append(
    el("h2", { text: "Preflight: would be admitted" }),
    el("p", { class: "banner ok", text: plan.message }),
    pairs([
      ["rows", `${plan.rows_kept} kept, ${plan.rows_rejected} rejected (of ${plan.rows_read} read)`],
      ["steps", `${plan.total_steps} (${plan.epochs} epoch(s) × ${plan.rows_kept} row(s))`],
      ["checkpoint segments", `${plan.grad_checkpoint_segments}${plan.auto_segments ? " (planned)" : " (as requested)"}`],
      ["tokens", `${plan.total_tokens} (supervised ${plan.total_supervised_tokens}); longest row ${plan.max_seq_len}`],
      ["learning rate", String(plan.learning_rate)],
      ["seed", drawn.has("seed") ? "drawn at submission" : String(plan.effective_config.seed)],
      ["adapter", drawn.has("output_name") ? "named at submission (sft-<job id>)" : plan.effective_config.output_name],
      ["largest LoRA rank that fits", el("span", { id: "preflight-max-rank", text: String(plan.max_lora_rank_that_fits) }),
      ],
      ["rank range", `${plan.lora_rank_range.minimum}..${plan.lora_rank_range.maximum}`],
      ["resume", plan.resume_checkpoint],
      ["kept corpus", el("span", {}, el("span", { class: "mono", text: plan.kept_corpus_sha256 }),
        el("span", { class: "note block", text: KEPT_CORPUS_NOTE }))],
    ]),
    memoryBar(plan.memory.breakdown, plan.memory.available_bytes),
  );
  if (plan.validation) {
    const v = plan.validation;
    const what = v.source === "holdout" ? `holdout ${v.holdout_percent}% of the rows` : v.source;
    box.append(el("h3", { text: "Validation (held out)" }), pairs([
      ["rows", `${what}: ${v.rows_kept} kept, ${v.rows_rejected} rejected (of ${v.rows_read} read)`],
      ["tokens", `${v.total_tokens} (supervised ${v.total_supervised_tokens}); longest row ${v.max_seq_len}`],
      ["evaluations", `${v.evaluations}${v.interval_steps ? ` (every ${v.interval_steps} steps and each epoch's end)` : " (the baseline and each epoch's end)"}`],
      ["forward memory", fmtBytes(v.memory.estimate_bytes)],
    ]));
  }
  if (plan.rejected_rows.length) {
    const table = el("table", { id: "preflight-rejected" },
      el("thead", {}, el("tr", {}, el("th", { text: "Row" }), el("th", { text: "Hash" }), el("th", { text: "Reason" }))));
    const tbody = el("tbody");
    for (const r of plan.rejected_rows) {
      tbody.append(el("tr", {}, el("td", { class: "num", text: r.line != null ? `${r.row_index} (line ${r.line})` : String(r.row_index) }), el("td", {}, el("span", { class: "mono", text: r.row_sha256 })), el("td", { text: r.reason })));
    }
    table.append(tbody);
    box.append(el("h3", { text: "Rejected rows (skipped, recorded in the receipt)" }), el("div", { class: "scroll" }, table));
  }
}

async function submitJob() {
  clearFieldErrors();
  const button = $("#sft-submit");
  if (button.disabled) return;
  button.disabled = true;
  const key = formKey;
  try {
    const body = await buildRequest();
    const { data } = await api("POST", "/v1/train/sft", { json: body, headers: { "Idempotency-Key": key } });
    location.hash = `#/jobs/${encodeURIComponent(data.job_id)}`;
  } catch (err) {
    showFailure(err, null, submitJob);
  } finally {
    button.disabled = false;
  }
}

async function uploadDataset() {
  const out = $("#sft-dataset-upload-result");
  out.textContent = "";
  $("#sft-dataset-file-error").textContent = "";
  const file = $("#sft-dataset-file").files[0];
  const name = $("#sft-dataset-name").value.trim();
  if (!file) return markField("sft-dataset-file", "choose a JSONL file to upload");
  if (!name) return markField("sft-dataset-file", "name the dataset");
  const policy = $("#sft-invalid-row-policy").value;
  const button = $("#sft-dataset-upload");
  button.disabled = true;
  try {
    const path = `/v1/datasets?name=${encodeURIComponent(name)}&invalid_row_policy=${policy}`;
    const { data } = await api("POST", path, { raw: file, rawType: "application/x-ndjson" });
    await loadChoices();
    $("#sft-dataset-select").value = data.dataset_path;
    setSource("stored");
    const s = data.stats;
    out.textContent = `Stored ${data.name}: ${s.rows_kept} row(s) kept, ${s.rows_rejected} rejected, ${s.tokens} tokens (${s.supervised_tokens} supervised).`;
  } catch (err) {
    if (err instanceof ApiFailure && (isUnreachable(err) || err.status >= 500)) markField("sft-dataset-file", describeFailure(err));
    else if (err instanceof ApiFailure) markField("sft-dataset-file", `${err.code}: ${err.message}`);
  } finally {
    button.disabled = false;
  }
}

function applyPrefill(prefill) {
  const c = prefill.config;
  const set = (id, value) => {
    $(`#${id}`).value = value === null || value === undefined ? "" : String(value);
  };
  if (prefill.examples) {
    $("#sft-dataset-text").value = prefill.examples.map((row) => JSON.stringify(row)).join("\n");
    setSource("text");
  } else if (prefill.dataset_path) {
    const select = $("#sft-dataset-select");
    if (!$$("option", select).some((o) => o.value === prefill.dataset_path)) {
      select.append(el("option", { value: prefill.dataset_path, text: prefill.dataset_path }));
    }
    select.value = prefill.dataset_path;
    setSource("stored");
  }
  set("sft-output-name", c.output_name);
  set("sft-epochs", c.epochs);
  set("sft-lora-rank", c.lora_rank);
  set("sft-lora-alpha", c.lora_alpha);
  alphaChosen = c.lora_alpha !== ALPHA_PER_RANK * c.lora_rank;
  $("#sft-allow-high-lora-scale").checked = Boolean(c.allow_high_lora_scale);
  $("#sft-optimizer").value = c.optimizer.kind;
  for (const input of $$(`[data-optimizer='${c.optimizer.kind}'] [data-key]`)) {
    const value = c.optimizer[input.dataset.key];
    if (input.type === "checkbox") input.checked = Boolean(value);
    else if (value !== undefined) input.value = String(value);
  }
  showOptimizerFields();
  set("sft-learning-rate", c.learning_rate);
  set("sft-seed", ""); // a resume runs with the checkpoint's seed
  $("#sft-invalid-row-policy").value = c.invalid_row_policy;
  $("#sft-detect-anomaly").checked = Boolean(c.detect_anomaly);
  $("#sft-adapter-smoke-test").checked = Boolean(c.adapter_smoke_test);
  set("sft-adapter-smoke-prompts", (c.adapter_smoke_prompts || []).join("\n"));
  syncSmokePrompts();
  set("sft-checkpoint-interval", ""); // adopted from the checkpoint
  set("sft-grad-checkpoint-segments", "");
  const validation = prefill.validation || {}; // a resume must evaluate the same held-out rows
  set("sft-holdout-percent", validation.holdout_percent);
  set("sft-validation-interval", validation.interval_steps);
  resumeValidation = validation.examples ? { examples: validation.examples }
    : validation.dataset_path ? { dataset_path: validation.dataset_path } : null;
  const base = $("#sft-base-adapter");
  base.value = $$("option", base).some((o) => o.value === c.base_adapter) ? c.base_adapter : "";
  const resume = $("#sft-resume-checkpoint");
  if (!$$("option", resume).some((o) => o.value === prefill.resume_checkpoint)) {
    resume.append(el("option", { value: prefill.resume_checkpoint, text: prefill.resume_checkpoint }));
  }
  resume.value = prefill.resume_checkpoint;
  $("#sft-advanced").open = true;
  formKey = randomKey();
}

// ----- jobs -------------------------------------------------------------------------------------

async function cancelJob(jobId) {
  const { data } = await api("DELETE", `/v1/train/queue/${encodeURIComponent(jobId)}`);
  return data;
}

async function showJobs() {
  const details = new Map();
  poll(async () => {
    const jobs = await get("/v1/train/status");
    const running = jobs.filter((j) => j.state === "running");
    await Promise.all(running.map(async (j) => details.set(j.job_id, await get(`/v1/train/jobs/${encodeURIComponent(j.job_id)}`))));
    const tbody = clear($("#jobs-table tbody"));
    $("#jobs-empty").hidden = jobs.length > 0;
    for (const job of [...jobs].reverse()) {
      const detail = details.get(job.job_id);
      const eta = job.state === "running" && detail ? fmtSeconds(etaSeconds(detail)) : job.state === "queued" ? `#${job.queue_position} in queue` : "–";
      const actions = el("td");
      if (!TERMINAL.has(job.state)) {
        actions.append(el("button", {
          type: "button", class: "small danger", dataset: { cancel: job.job_id }, text: "Cancel",
          onclick: async (event) => {
            event.target.disabled = true;
            try {
              await cancelJob(job.job_id);
            } catch (err) {
              showActionError(err, route);
            }
          },
        }));
      }
      tbody.append(el("tr", { dataset: { job: job.job_id, state: job.state } },
        el("td", {}, el("a", { href: `#/jobs/${encodeURIComponent(job.job_id)}`, class: "mono", text: job.job_id })),
        el("td", { text: job.adapter_name || "–" }),
        el("td", {}, el("span", { class: `state ${job.state}`, text: job.state }),
          job.failure_reason ? el("span", { class: "muted", text: ` ${job.failure_reason}` }) : null),
        el("td", { class: "num", text: `${job.global_step}/${job.total_steps} (${Math.round(job.progress * 100)}%)` }),
        el("td", { class: "num", text: fmtLoss(job.current_loss) }),
        el("td", { class: "num eta", text: eta }),
        actions));
    }
    labelCells($("#jobs-table"));
  }, JOBS_POLL_MS);
}

const FAILURES = {
  cancelled: "The job was cancelled. Checkpoints it wrote before stopping can resume it.",
  worker_lost: "The worker running the job stopped answering (killed, crashed or its host went away) and the job could not be resumed from a checkpoint within its attempts.",
  plan_drift: "The worker's model, tokenizer or plan no longer matched what admission pinned for this job, so it was not run on different terms.",
  nan_loss: "The loss became NaN or infinite. Lower the learning rate, or turn on “Detect gradient anomalies” to name the operation that produced it.",
  oom: "The device ran out of memory during a step, beyond what admission estimated. Lower the LoRA rank, send shorter rows or free device memory.",
  data_schema_error: "A row of the data did not have the shape training needs when the worker re-read it.",
  adapter_load_failed: "The base adapter named for the warm start could not be loaded.",
  base_adapter_missing: "The base adapter named for the warm start is no longer in the registry.",
  shape_mismatch: "The base adapter's tensors do not fit this model or this LoRA rank.",
  unsafe_lora_scale: "The LoRA scale (alpha / rank) is above the safe limit.",
  unsupported_loss_config: "The resident backend cannot run this loss configuration.",
  training_error: "Training raised an error; the message below says where.",
  zero_action_tokens: "No row had a supervised token to train on.",
};

function explainFailure(detail) {
  const reason = detail.failure_reason;
  const words = FAILURES[reason] || `The job failed (${reason || "no reason recorded"}).`;
  return detail.error ? `${words} ${reason ? `[${reason}] ` : ""}${detail.error}` : words;
}

/** The receipt's validation section in one line (undefined without validation). */
function validationText(validation) {
  const evaluations = (validation && validation.evaluations) || [];
  if (!evaluations.length) return undefined;
  const first = evaluations[0];
  const last = evaluations[evaluations.length - 1];
  const best = validation.best;
  return `loss ${fmtLoss(first.loss)} → ${fmtLoss(last.loss)}, token accuracy ${first.token_accuracy.toFixed(4)} → ${last.token_accuracy.toFixed(4)}`
    + (best ? `; best ${fmtLoss(best.loss)} at step ${best.global_step}` : "")
    + ` (${evaluations.length} evaluations of ${validation.rows} held-out rows)`;
}

function receiptView(detail) {
  const receipt = detail.train_receipt;
  if (!receipt) return el("p", { class: "muted", text: TERMINAL.has(detail.state) ? "No receipt was written." : "Written when the run ends." });
  const hyper = receipt.hyperparameters || {};
  const runtime = receipt.runtime || {};
  const timings = receipt.phase_timings || {};
  const precision = runtime.training_precision;
  const wall = runtime.wall_clock_ms;
  // Steps trained, from the receipt itself (one row per step), so the job page and the adapter's
  // receipt view give the same figure; the job's own history where an older receipt lacks it.
  const history = detail.loss_history || [];
  const steps = (receipt.data || {}).examples_trained || (history.length ? history[history.length - 1].step : detail.global_step);
  const meanStep = wall && steps ? wall / 1000 / steps : null;
  const phases = Object.entries(timings).filter(([k, v]) => k.endsWith("_ms") && v > 0).map(([k, v]) => `${k.replace(/_ms$/, "")} ${Math.round(v)} ms`);
  const view = el("div", { id: "receipt-summary" }, pairs([
    ["status", receipt.status],
    ["failure", receipt.failure_reason || undefined],
    ["loss route", runtime.sft_loss_route],
    ["learning rate", fmtNumber(hyper.learning_rate)],
    ["seed", hyper.seed],
    ["rank / alpha", `${fmtNumber(hyper.rank)} / ${fmtNumber(hyper.alpha)}`],
    ["epochs", fmtNumber(hyper.epochs)],
    ["precision", precision && typeof precision === "object"
      ? `params ${precision.parameter_dtype}, activations ${precision.activation_dtype}, grads ${precision.gradient_dtype}, optimizer state ${precision.optimizer_state_dtype}`
      : fmtNumber(precision)],
    ["training wall clock", wall === null || wall === undefined ? "–" : fmtSeconds(wall / 1000)],
    ["mean step time", meanStep === null ? "–" : `${(meanStep * 1000).toFixed(0)} ms`],
    ["job elapsed", detail.elapsed_secs === undefined ? undefined : fmtSeconds(detail.elapsed_secs)],
    ["phase timings", phases.length ? phases.join(", ") : undefined],
    ["peak memory", fmtBytes(runtime.peak_memory_bytes)],
    ["supervised tokens", fmtNumber((receipt.token_counts || {}).action_tokens)],
    ["validation", validationText(receipt.validation)],
  ]));
  const smoke = receipt.adapter_smoke_test;
  if (smoke && Array.isArray(smoke.prompts) && smoke.prompts.length) {
    const table = el("table", { id: "canary-table" }, el("thead", {}, el("tr", {},
      el("th", { text: "Prompt" }), el("th", { text: "Base" }), el("th", { text: "Adapter" }), el("th", { text: "ms base / adapter" }))));
    const tbody = el("tbody");
    for (const p of smoke.prompts) {
      tbody.append(el("tr", {}, el("td", { text: p.prompt }), el("td", { text: p.base_output }), el("td", { text: p.adapter_output }),
        el("td", { class: "num", text: `${fmtMs(p.base_generation_ms)} / ${fmtMs(p.adapter_generation_ms)}` })));
    }
    table.append(tbody);
    view.append(el("h3", { text: `Canaries: ${smoke.passed ? "passed" : "did not pass"}` }));
    const random = (receipt.model || {}).random_init;
    if (random) {
      view.append(el("p", { class: "note", id: "canary-random", text: `The base model is a random checkpoint `
        + `(preset ${random.preset}, seed ${fmtNumber(random.seed)}), so both columns are gibberish by construction: `
        + "the canaries only check that the adapter loads, changes the base model's output and stays fast. "
        + "Train on a real Qwen3.5 checkpoint (model.path) for answers worth reading." }));
    }
    view.append(el("div", { class: "scroll" }, table));
    for (const w of smoke.warnings || []) view.append(el("p", { class: "note", text: w }));
  }
  return view;
}

/** The model a job trains on, in words (a random checkpoint says so). */
function modelText(model) {
  if (!model) return "";
  const random = model.random_init;
  return `model ${model.path}` + (random ? ` (a random ${random.preset} checkpoint: the run shows the mechanics, not a useful model)` : "");
}

/** Whether a job evaluates held-out rows (its chart then draws a validation line). */
function hasValidation(detail) {
  return (detail.validation_history || []).length > 0 || Boolean(detail.replay_request && detail.replay_request.validation);
}

/** The job's chart: a sentence until the first point, then the curves (a validation line only
 * for a job with validation, so its legend never shows an empty one). */
function drawJobChart(box, state, detail) {
  const data = jobSeries(detail);
  const withValidation = hasValidation(detail);
  if (data[0].length === 0) {
    state.chart = null;
    clear(box).append(el("p", { class: "muted chart-empty", text: TERMINAL.has(detail.state)
      ? "This job trained no step, so there is no loss curve."
      : "The loss curve appears here after the first training step." }));
    box.dataset.points = "0";
    box.dataset.validationPoints = "0";
    return;
  }
  if (!state.chart || state.withValidation !== withValidation) {
    state.chart = lossChart(box, withValidation ? JOB_LINES : JOB_LINES.slice(0, 2));
    state.withValidation = withValidation;
  }
  setChartData(box, state.chart, withValidation ? data : data.slice(0, 3));
  // The validation points the chart draws (non-null values of its validation line).
  box.dataset.validationPoints = String(withValidation ? data[3].filter((v) => v !== null && v !== undefined).length : 0);
}

async function showJob(jobId) {
  setText("job-id", jobId);
  const chartBox = $("#job-loss-chart");
  const chartState = { chart: null, withValidation: null };
  clear(chartBox).append(el("p", { class: "muted chart-empty", text: "Loading the job." }));
  const events = clear($("#job-events"));
  clear($("#job-receipt"));
  clear($("#job-checkpoints"));
  $("#job-failure").hidden = true;
  let cursor = null;
  let detail = null;
  let finalPass = false;
  const cancel = $("#job-cancel");
  cancel.onclick = async () => {
    cancel.disabled = true;
    try {
      await cancelJob(jobId);
    } catch (err) {
      showActionError(err, route);
    }
  };
  poll(async () => {
    try {
      detail = await get(`/v1/train/jobs/${encodeURIComponent(jobId)}`);
    } catch (err) {
      if (detail === null) {
        clear(chartBox).append(el("p", { class: "muted chart-empty", text: "The job could not be loaded (see the message above)." }));
        setText("job-state", "unknown");
      }
      throw err;
    }
    const stateNode = $("#job-state");
    stateNode.textContent = detail.state;
    stateNode.className = `state ${detail.state}`;
    setText("job-steps", `${detail.global_step}/${detail.total_steps}`);
    setText("job-loss", `loss ${fmtLoss(detail.current_loss)}`);
    const eta = etaSeconds(detail);
    setText("job-eta", detail.state === "queued" ? `queue position ${detail.queue_position}` : eta === null ? "" : `ETA ${fmtSeconds(eta)}`);
    setText("job-adapter", detail.adapter_name ? `adapter ${detail.adapter_name}` : "");
    setText("job-model", modelText(detail.model));
    cancel.hidden = TERMINAL.has(detail.state);
    if (cancel.hidden) cancel.disabled = false;
    drawJobChart(chartBox, chartState, detail);
    const evaluations = detail.validation_history || [];
    const last = evaluations[evaluations.length - 1];
    setText("job-validation", last ? `validation loss ${fmtLoss(last.loss)}, token accuracy ${last.token_accuracy.toFixed(4)}` : "");
    for (;;) {
      const after = cursor === null ? "" : `&after=${cursor}`;
      const page = await get(`/v1/train/jobs/${encodeURIComponent(jobId)}/events?limit=500${after}`);
      for (const e of page.data) {
        events.append(el("li", { class: e.level, dataset: { kind: e.kind } },
          el("span", { class: "when", text: new Date(e.created_at).toLocaleTimeString() }),
          el("strong", { text: `${e.kind} ` }), e.message));
      }
      if (page.last_id !== null) cursor = page.last_id;
      if (!page.has_more) break;
    }
    const failure = $("#job-failure");
    failure.hidden = detail.state !== "failed";
    if (detail.state === "failed") failure.textContent = explainFailure(detail);
    clear($("#job-receipt")).append(receiptView(detail));
    await showCheckpoints(detail);
    if (TERMINAL.has(detail.state)) {
      if (finalPass) return false;
      finalPass = true; // one more pass picks up the last events
    }
    return true;
  }, POLL_MS);
}

function noCheckpointsText(detail) {
  if (detail.state === "completed") return "This run left no checkpoints; its adapter is the result (checkpoints only matter to resume a stopped run).";
  if (detail.state === "failed") return "This run wrote no checkpoint before it stopped, so it cannot be resumed; submit it again.";
  return "None yet: one is written every checkpoint interval (SFT Advanced) while the job runs.";
}

async function showCheckpoints(detail) {
  const box = $("#job-checkpoints");
  const none = () => clear(box).append(el("p", { class: "muted", text: noCheckpointsText(detail) }));
  if (!detail.adapter_name) return none();
  const { checkpoints } = await get(`/v1/checkpoints?adapter=${encodeURIComponent(detail.adapter_name)}`);
  clear(box);
  if (!checkpoints.length) return none();
  const tbody = el("tbody");
  // Admission resumes from the newest checkpoint only: a run from an older one would have to
  // publish the later checkpoints' names again.
  const newest = Math.max(...checkpoints.map((c) => c.global_step));
  for (const c of checkpoints) {
    const s = c.summary;
    // A completed run published its adapter: only a stopped one has something left to resume.
    const canResume = s && !s.complete && detail.state === "failed" && detail.replay_request && c.global_step === newest;
    tbody.append(el("tr", { dataset: { checkpoint: c.resume_checkpoint } },
      el("td", { class: "num", text: s ? `${s.global_step}/${s.total_steps}` : String(c.global_step) }),
      el("td", { text: s ? fmtTime(Date.parse(s.created_at)) : c.error }),
      el("td", {}, canResume ? el("button", {
        type: "button", class: "small resume", text: "Resume from here",
        onclick: () => {
          pendingPrefill = {
            examples: detail.replay_request.examples || null,
            dataset_path: detail.replay_request.dataset_path || null,
            validation: detail.replay_request.validation || null,
            config: s.effective_config,
            resume_checkpoint: c.resume_checkpoint,
          };
          location.hash = "#/train";
        },
      }) : el("span", { class: "muted", text: s && s.complete ? "complete" : c.global_step < newest ? "a later checkpoint exists" : "" }))));
  }
  box.append(el("div", { class: "scroll" }, el("table", {},
    el("thead", {}, el("tr", {}, el("th", { text: "Step" }), el("th", { text: "Written" }), el("th", {}, el("span", { class: "sr", text: "Actions" })))),
    tbody)));
}

// ----- the data inspector -----------------------------------------------------------------------

// What the terminal inspector escapes too: controls, bidi overrides, separators, span markers.
const INVISIBLE = /[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufdd0\ufdd1]/g;

/** Text as nodes, with invisible characters shown as visible escapes. */
function visibleNodes(text) {
  const nodes = [];
  let last = 0;
  for (const m of text.matchAll(INVISIBLE)) {
    if (m.index > last) nodes.push(document.createTextNode(text.slice(last, m.index)));
    const code = m[0].codePointAt(0);
    nodes.push(el("span", { class: "esc", text: code < 0x100 ? `\\x${code.toString(16).padStart(2, "0")}` : `\\u${code.toString(16).padStart(4, "0")}` }));
    last = m.index + m[0].length;
  }
  if (last < text.length) nodes.push(document.createTextNode(text.slice(last)));
  return nodes;
}

function inspectedRow(row) {
  const f = row.facts;
  const kept = f.rejection === undefined;
  const header = el("header", {},
    el("strong", { text: `row ${f.row_index}` }),
    f.line != null && el("span", { class: "line", text: `line ${f.line}` }),
    f.format && el("span", { class: "format", title: f.conversion || "", text: f.format }),
    el("span", { class: "hash mono", text: f.row_sha256 }),
    kept
      ? el("span", { class: "counts", text: `tokens ${f.seq_len} · supervised ${f.supervised_tokens}` })
      : el("span", { class: "reason", text: `REJECTED ${f.rejection}: ${f.detail || ""}` }));
  const article = el("article", { class: `row ${kept ? "kept" : "rejected"}`, dataset: { row: String(f.row_index) } }, header);
  if (row.pieces) {
    const pre = el("pre", { class: "rendering" });
    for (const piece of row.pieces) {
      if (piece.token === null) pre.append(...visibleNodes(piece.text));
      else pre.append(el("span", { class: piece.supervised ? "tok supervised" : "tok", dataset: { token: String(piece.token) } }, ...visibleNodes(piece.text)));
    }
    article.append(pre);
  } else if (row.text !== null) {
    article.append(el("pre", { class: "rendering" }, ...visibleNodes(row.text)));
  }
  return article;
}

function inspectSummary(answer) {
  const receipt = answer.receipt;
  if (answer.error) {
    return el("p", { class: "banner error", id: "inspect-verdict" }, el("strong", { text: `${answer.error.code}: ` }), answer.error.message);
  }
  return el("p", { class: "banner ok", id: "inspect-verdict",
    text: `${receipt.rows_read} row(s) read, ${receipt.rows_kept} kept, ${receipt.rows_rejected} rejected (policy ${answer.invalid_row_policy}); tokens ${answer.tokens}, supervised ${answer.supervised_tokens}` });
}

let inspectWired = false;

async function showInspect() {
  const datasets = await get("/v1/datasets");
  fillSelect($("#inspect-select"), datasets.datasets.map((d) => ({ value: d.name, label: d.name })), "—");
  if (inspectWired) return;
  inspectWired = true;
  $("#inspect-form").addEventListener("submit", (event) => {
    event.preventDefault();
    runInspect(0).catch((err) => showGlobalError(err.message));
  });
}

async function inspectRequest(offset) {
  const policy = $("#inspect-policy").value;
  const query = `invalid_row_policy=${policy}&offset=${offset}&limit=100`;
  const file = $("#inspect-file").files[0];
  const stored = $("#inspect-select").value;
  const text = $("#inspect-text").value.trim();
  if (file) return api("POST", `/v1/data/inspect?${query}`, { raw: file, rawType: "application/x-ndjson" });
  if (stored) return api("GET", `/v1/datasets/${encodeURIComponent(stored)}/inspect?${query}`);
  if (text) {
    let body = text;
    try {
      const whole = JSON.parse(text);
      if (Array.isArray(whole)) body = whole.map((row) => JSON.stringify(row)).join("\n");
    } catch (_) {
      /* JSON Lines as pasted */
    }
    return api("POST", `/v1/data/inspect?${query}`, { raw: body, rawType: "application/x-ndjson" });
  }
  throw new Error("Choose a file, a stored dataset or paste rows to inspect.");
}

async function runInspect(offset) {
  const box = $("#inspect-result");
  if (offset === 0) clear(box);
  const more = $("#inspect-more");
  if (more) more.remove();
  const button = $("#inspect-run");
  button.disabled = true;
  try {
    const { data } = await inspectRequest(offset);
    if (offset === 0) box.append(inspectSummary(data), el("p", { class: "note", text: `tokenizer: ${data.tokenizer}` }));
    for (const row of data.rows) box.append(inspectedRow(row));
    if (data.has_more) {
      box.append(el("button", { type: "button", id: "inspect-more", text: "More rows",
        onclick: () => runInspect(data.offset + data.rows.length).catch((err) => showGlobalError(err.message)) }));
    }
  } catch (err) {
    if (err instanceof ApiFailure || err instanceof Error) {
      const sentence = err instanceof ApiFailure && (isUnreachable(err) || err.status >= 500);
      box.append(el("p", { class: "banner error" }, sentence ? problemNodes(err, () => runInspect(offset)) : [err.code ? el("strong", { text: `${err.code}: ` }) : null, err.message]));
    }
  } finally {
    button.disabled = false;
  }
}

// ----- adapters ---------------------------------------------------------------------------------

async function download(name) {
  const headers = {};
  if (token()) headers.Authorization = `Bearer ${token()}`;
  let response;
  try {
    response = await fetch(`/v1/adapters/${encodeURIComponent(name)}/download`, { headers, credentials: "omit" });
  } catch (err) {
    throw new ApiFailure(0, { code: "unreachable", message: `the Kiln api cannot be reached (${err.message})` });
  }
  if (!response.ok) {
    const body = await response.json().catch(() => null);
    throw new ApiFailure(response.status, body && body.error ? body.error : { code: `http_${response.status}`, message: "the download failed" });
  }
  const url = URL.createObjectURL(await response.blob());
  const link = el("a", { href: url, download: `${name}.tar.gz` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 30000);
}

async function showReceipt(name) {
  const box = clear($("#adapter-receipt"));
  const { data } = await api("GET", `/v1/adapters/${encodeURIComponent(name)}/receipt`);
  box.append(el("h2", { text: `Receipt of ${name}` }), receiptView({ train_receipt: data, state: "completed" }));
  box.scrollIntoView({ block: "nearest" });
}

function confirmButton(label, action) {
  let armed = false;
  let timer = null;
  const button = el("button", { type: "button", class: "small danger", text: label });
  button.addEventListener("click", async () => {
    if (!armed) {
      armed = true;
      button.textContent = `Confirm ${label.toLowerCase()}`;
      timer = setTimeout(() => {
        armed = false;
        button.textContent = label;
      }, 5000);
      return;
    }
    clearTimeout(timer);
    button.disabled = true;
    try {
      await action();
    } catch (err) {
      showActionError(err, route);
      button.disabled = false;
    }
  });
  return button;
}

async function showAdapters() {
  const [adapters, jobs, datasets] = await Promise.all([get("/v1/adapters"), get("/v1/train/status"), get("/v1/datasets")]);
  const tbody = clear($("#adapters-table tbody"));
  $("#adapters-empty").hidden = adapters.adapters.length > 0;
  for (const a of adapters.adapters) {
    tbody.append(el("tr", { dataset: { adapter: a.name } },
      el("td", {}, el("strong", { text: a.name })),
      el("td", { text: fmtTime(Date.parse(a.created_at)) }),
      el("td", { class: "num", text: `${a.rank} / ${a.alpha}` }),
      el("td", { class: "num", text: fmtBytes(a.size_bytes) }),
      el("td", { class: "num", text: String(a.checkpoints.length) }),
      el("td", {}, a.job_id ? el("a", { href: `#/jobs/${encodeURIComponent(a.job_id)}`, class: "mono", text: a.job_id }) : "–"),
      el("td", { class: "row-actions" },
        el("button", { type: "button", class: "small receipt", text: "Receipt", onclick: function again() { showReceipt(a.name).catch((err) => showActionError(err, again)); } }),
        el("button", { type: "button", class: "small download", text: "Download", onclick: function again() { download(a.name).catch((err) => showActionError(err, again)); } }),
        confirmButton("Delete", async () => {
          await api("DELETE", `/v1/adapters/${encodeURIComponent(a.name)}`);
          await showAdapters();
        }))));
  }
  labelCells($("#adapters-table"));
  const runs = jobs.filter((j) => j.global_step > 0).reverse()
    .map((j) => ({ value: j.job_id, label: `${j.adapter_name} (${j.state}, ${j.global_step} steps)` }));
  fillSelect($("#compare-a"), runs, "— run —");
  fillSelect($("#compare-b"), runs, "— run —");
  const dtbody = clear($("#datasets-table tbody"));
  for (const d of datasets.datasets) {
    const s = d.stats;
    dtbody.append(el("tr", { dataset: { dataset: d.name } },
      el("td", {}, el("strong", { text: d.name })),
      el("td", { class: "num", text: s ? `${s.rows_kept} / ${s.rows_rejected}` : "–" }),
      el("td", { class: "num", text: s ? String(s.tokens) : "–" }),
      el("td", { class: "num", text: s ? String(s.supervised_tokens) : "–" }),
      el("td", {}, el("span", { class: "mono", text: d.sha256 || "–" })),
      el("td", {}, confirmButton("Delete", async () => {
        await api("DELETE", `/v1/datasets/${encodeURIComponent(d.name)}`);
        await showAdapters();
      }))));
  }
  labelCells($("#datasets-table"));
  const form = $("#compare-form");
  form.onsubmit = (event) => {
    event.preventDefault();
    compareRuns().catch((err) => {
      $("#compare-error").textContent = err.message;
    });
  };
}

async function compareRuns() {
  $("#compare-error").textContent = "";
  const a = $("#compare-a").value;
  const b = $("#compare-b").value;
  if (!a || !b || a === b) throw new Error("Choose two different runs.");
  const [da, db] = await Promise.all([a, b].map((id) => get(`/v1/train/jobs/${encodeURIComponent(id)}`)));
  const steps = [...new Set([...da.loss_history, ...db.loss_history].map((p) => p.step))].sort((x, y) => x - y);
  const at = (detail) => {
    const byStep = new Map(detail.loss_history.map((p) => [p.step, p.loss]));
    return steps.map((s) => (byStep.has(s) ? byStep.get(s) : null));
  };
  const box = $("#compare-chart");
  box.hidden = false;
  const chart = lossChart(box, [{ label: `${da.adapter_name} (A)` }, { label: `${db.adapter_name} (B)` }]);
  setChartData(box, chart, [steps, at(da), at(db)]);
}

// ----- start ------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("#auth-form").addEventListener("submit", signIn);
  $("#auth-signout").addEventListener("click", signOut);
  $("#auth-signout").hidden = !token();
  window.addEventListener("hashchange", route);
  route();
});
