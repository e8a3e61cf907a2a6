// Kiln's console: polls /status (startup, ledger) and /metrics (load), reads the model and its settings once the
// server is ready, and streams chat replies from /v1/chat/completions. Plain JS, no library, no request but
// Kiln's own routes.
"use strict";

const config = JSON.parse(document.getElementById("kiln-config").textContent);
const $ = (id) => document.getElementById(id);
const KEY_STORE = "kiln-api-key";
const MIB = 2 ** 20;
const GIB = 2 ** 30;

// ------------------------------------------------------------------------------------------------ formatting
// human(): kiln.core.units.human, so the page's figures read as `kiln plan` and the log print them
function human(n) {
  if (Math.abs(n) >= GIB) return `${(n / GIB).toFixed(2)} GiB`;
  if (Math.abs(n) >= MIB) return `${(n / MIB).toFixed(1)} MiB`;
  return `${n.toLocaleString("en-US")} B`;
}
const seconds = (s) => (s == null ? "—" : `${s.toFixed(1)} s`);
const percent = (x) => (x == null || Number.isNaN(x) ? "—" : `${(100 * x).toFixed(1)} %`);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") Object.assign(node.style, v);
    else node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

function fillGrid(dl, pairs) {
  dl.replaceChildren(
    ...pairs.filter(([, v]) => v != null && v !== "").flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))]),
  );
}

// ------------------------------------------------------------------------------------------------ the API key
// The page itself is served without the key (it holds no data); the data routes answer 401 without it. The key
// is asked for once and kept for this tab only (sessionStorage).
let keyPrompt = null;

function askForKey(refused) {
  if (!keyPrompt) {
    keyPrompt = new Promise((resolve) => {
      $("key-message").textContent = refused
        ? "The server refused that key: enter it again."
        : "This server needs its API key (--api-key).";
      $("key-panel").hidden = false;
      $("key-input").focus();
      $("key-panel").onsubmit = (event) => {
        event.preventDefault();
        sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
        $("key-panel").hidden = true;
        keyPrompt = null;
        resolve();
      };
    });
  }
  return keyPrompt;
}

// fetch() for the routes behind --api-key: waits for the key where the server needs one, asks again on a 401
async function api(path, options = {}) {
  for (;;) {
    if (config.auth && !sessionStorage.getItem(KEY_STORE)) await askForKey(false);
    const key = sessionStorage.getItem(KEY_STORE);
    const headers = { ...(options.headers || {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    sessionStorage.removeItem(KEY_STORE);
    await askForKey(true);
  }
}

// ------------------------------------------------------------------------------------------------ startup
let ready = false;
let modelId = null;

// The phases in the order they ran (timings keep it), the current one, then those predicted but not reached yet.
function phaseRows(status) {
  const predicted = status.predicted_s || {};
  const rows = Object.entries(status.timings || {}).map(([phase, actual]) => ({ phase, actual }));
  const done = rows.reduce((sum, r) => sum + r.actual, 0);
  const live = !["ready", "failed", "shutting_down"].includes(status.phase);
  if (live) rows.push({ phase: status.phase, actual: Math.max(0, status.elapsed - done), current: true });
  for (const phase of Object.keys(predicted)) {
    if (phase !== "total" && phase !== "ready" && !rows.some((r) => r.phase === phase)) {
      rows.push({ phase, actual: null });
    }
  }
  for (const r of rows) r.predicted = predicted[r.phase] ?? null;
  return { rows, done };
}

function renderStartup(status) {
  const phase = status.phase;
  $("phase").textContent = phase;
  $("phase").className = `badge ${phase === "ready" ? "ready" : phase === "failed" ? "failed" : ""}`;
  const { rows, done } = phaseRows(status);
  // without predictions in /status (an older server, or none made) only the actual seconds are shown
  $("timeline").classList.toggle("no-prediction", !status.predicted_s);
  const scale = Math.max(1e-9, ...rows.map((r) => Math.max(r.actual || 0, r.predicted || 0)));
  $("timeline").tBodies[0].replaceChildren(
    ...rows.map((r) => {
      const track = el("div", { class: "track" });
      if (r.predicted != null) track.append(el("div", { class: "predicted", style: { width: `${(100 * r.predicted) / scale}%` } }));
      if (r.actual != null) track.append(el("div", { class: "actual", style: { width: `${(100 * r.actual) / scale}%` } }));
      return el(
        "tr",
        { class: r.current ? "current" : "", "data-phase": r.phase },
        el("td", {}, r.phase),
        el("td", {}, track),
        el("td", {}, r.actual == null ? "" : seconds(r.actual)),
        el("td", {}, r.predicted == null ? "" : seconds(r.predicted)),
      );
    }),
  );
  const total = ready ? done : status.elapsed;
  const predictedTotal = status.predicted_s && status.predicted_s.total;
  $("startup-total").textContent =
    `${ready ? "ready in" : "elapsed"} ${seconds(total)}` + (predictedTotal != null ? ` (predicted ${seconds(predictedTotal)})` : "");
  $("eta").textContent = !ready && status.eta_s != null ? `ready in ~${seconds(status.eta_s)}` : "";
  const error = status.error;
  $("startup-error").hidden = !error;
  if (error) $("startup-error").textContent = `failed in ${error.phase}: ${error.reason}${error.hint ? `\nhint: ${error.hint}` : ""}`;
}

// ------------------------------------------------------------------------------------------------ memory
const LINE_KIND = {
  weights: "weights", "packed lm head": "weights", "draft weights": "weights", "lora adapter slots": "weights",
  "kv pool": "kv", "state pool": "kv", "state checkpoints": "kv", "draft guess slots": "kv",
  "graph reserve": "graphs",
  "prefill activations": "activations", "logits buffer": "activations", "request table": "activations",
  headroom: "headroom",
};
let shownLedger = "";

// The ledger's device lines: those between "available" (what they share) and "headroom" (what is left), less the
// per-token KV figure, which is no allocation. Host-tier lines after headroom are not device memory.
function renderLedger(ledger) {
  const text = JSON.stringify(ledger);
  if (!ledger || text === shownLedger) return;
  shownLedger = text;
  const lines = ledger.lines || [];
  const available = lines.find((x) => x.name === "available");
  const end = lines.findIndex((x) => x.name === "headroom");
  const parts = lines.slice(lines.indexOf(available) + 1, end + 1).filter((x) => x.name !== "kv bytes per token");
  const total = available ? available.bytes : parts.reduce((sum, x) => sum + Math.max(0, x.bytes), 0);
  $("ledger-total").textContent = `${ledger.device}, tp ${ledger.tp_size}, per rank: ${human(total)} available`;
  $("ledger-bar").replaceChildren(
    ...parts.filter((x) => x.bytes > 0).map((x) =>
      el("div", {
        class: LINE_KIND[x.name] || "other",
        title: `${x.name}: ${human(x.bytes)} (${x.inputs})`,
        style: { flex: `${x.bytes} 0 0` },
      }),
    ),
  );
  $("ledger-lines").replaceChildren(
    ...parts.map((x) =>
      el(
        "li",
        { title: x.inputs, "data-line": x.name },
        el("span", { class: `swatch ${LINE_KIND[x.name] || "other"}` }),
        `${x.name} `,
        el("span", { class: "figure" }, human(x.bytes)),
      ),
    ),
    el("li", { class: "muted" }, `KV pool: ${ledger.max_total_num_tokens.toLocaleString("en-US")} tokens`),
  );
}

async function pollStatus() {
  try {
    const response = await fetch("status");
    const status = await response.json();
    const nowReady = status.phase === "ready";
    if (nowReady && !ready) {
      ready = true;
      loadInfo().catch((err) => fillGrid($("settings"), [["error", err.message]]));
      if (config.metrics) pollMetrics();
    }
    renderStartup(status);
    renderLedger(status.ledger);
  } catch (err) {
    $("phase").textContent = "unreachable";
    $("phase").className = "badge failed";
  }
  // every second while starting (the timeline moves); then only for a restart's sake
  setTimeout(pollStatus, ready ? 10000 : 1000);
}

// ------------------------------------------------------------------------------------------------ model and settings
async function loadInfo() {
  const models = await (await api("v1/models")).json();
  if (!models.data) throw new Error(`/v1/models: ${JSON.stringify(models)}`);
  modelId = models.data[0].id;
  $("model").textContent = modelId;
  const info = await (await api("get_server_info")).json();
  const args = info.server_args || {};
  fillGrid($("settings"), [
    ["model", modelId],
    ["device", info.device],
    ["tp size", info.tp_size],
    ["dtype", info.dtype || args.dtype],
    ["KV cache dtype", info.kv_cache_dtype || args.kv_cache_dtype],
    ["context length", info.context_len],
    ["KV pool tokens", info.max_total_num_tokens],
    ["max running requests", info.max_running_requests],
    ["chunked prefill", info.chunked_prefill_size],
    ["attention backend", info.attention_backend || args.attention_backend],
    ["speculative", args.speculative_algorithm],
    ["prefix cache", args.disable_radix_cache ? "off" : "on"],
    ["version", info.version],
  ]);
}

// ------------------------------------------------------------------------------------------------ load
const SERIES = [
  "kiln:num_running_reqs", "kiln:num_queue_reqs", "kiln:generation_tokens_total", "kiln:token_usage",
  "kiln:cache_hit_rate", "sglang:spec_accept_rate", "sglang:spec_accept_length",
];
let lastTokens = null;

// Prometheus text, only the series shown: the first sample of each (Kiln's own series carry no labels)
function parseMetrics(text) {
  const found = {};
  for (const line of text.split("\n")) {
    const m = /^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)/.exec(line);
    if (m && SERIES.includes(m[1]) && !(m[1] in found)) found[m[1]] = parseFloat(m[2]);
  }
  return found;
}

async function pollMetrics() {
  try {
    const response = await fetch("metrics");
    if (response.status === 404) {
      fillGrid($("load"), [["metrics", "off (--disable-metrics)"]]);
      return;
    }
    const m = parseMetrics(await response.text());
    const now = performance.now();
    const tokens = m["kiln:generation_tokens_total"];
    let rate = null;
    if (lastTokens && tokens != null) rate = ((tokens - lastTokens.tokens) * 1000) / (now - lastTokens.at);
    if (tokens != null) lastTokens = { tokens, at: now };
    const spec = m["sglang:spec_accept_rate"];
    fillGrid($("load"), [
      ["running requests", m["kiln:num_running_reqs"]],
      ["queued requests", m["kiln:num_queue_reqs"]],
      ["generation", rate == null ? "—" : `${rate.toFixed(1)} tokens/s`],
      ["KV usage", percent(m["kiln:token_usage"])],
      ["prefix hit rate", percent(m["kiln:cache_hit_rate"])],
      ["spec acceptance", spec == null ? null : `${percent(spec)}, ${(m["sglang:spec_accept_length"] ?? NaN).toFixed(2)} tokens/step`],
    ]);
  } catch (err) {
    fillGrid($("load"), [["metrics", "unreachable"]]);
  }
  setTimeout(pollMetrics, 2000);
}

// ------------------------------------------------------------------------------------------------ chat
const history = [];

// Reads the SSE stream of /v1/chat/completions, appending each delta to `reply` as it arrives.
async function streamReply(response, reply) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let text = "";
  let chunks = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6).trim();
      if (data === "[DONE]") return text;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message);
      const delta = event.choices && event.choices[0] && event.choices[0].delta;
      if (delta && delta.content) {
        text += delta.content;
        reply.textContent = text;
        reply.dataset.chunks = String(++chunks);
      }
    }
  }
  return text;
}

async function sendChat(event) {
  event.preventDefault();
  const content = $("chat-input").value.trim();
  if (!content || !modelId) return;
  $("chat-input").value = "";
  $("chat-send").disabled = true;
  const log = $("chat-log");
  log.append(el("div", { class: "msg user" }, content));
  const reply = el("div", { class: "msg assistant", "data-state": "streaming" });
  log.append(reply);
  history.push({ role: "user", content });
  try {
    const response = await api("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model: modelId,
        messages: history,
        stream: true,
        max_tokens: parseInt($("chat-max-tokens").value, 10) || 256,
      }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${response.status}`);
    }
    history.push({ role: "assistant", content: await streamReply(response, reply) });
    reply.dataset.state = "done";
  } catch (err) {
    history.pop();
    reply.classList.add("error");
    reply.textContent = `${reply.textContent}\n[${err.message}]`.trim();
    reply.dataset.state = "error";
  } finally {
    $("chat-send").disabled = false;
    log.scrollTop = log.scrollHeight;
  }
}

$("chat-form").addEventListener("submit", sendChat);
$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) sendChat(event);
});
// the key up front, while the server starts: what needs it runs once the server is ready
if (config.auth && !sessionStorage.getItem(KEY_STORE)) askForKey(false);
pollStatus();
