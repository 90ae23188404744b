// The Conduit playground: chat over the /v1/ws WebSocket (docs/websocket.md) and a live view of /metrics.
// Plain browser JavaScript, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { ws: null, open: null, live: null, history: [], seq: 0, last: null };

function apiKey() { return $("api-key").value.trim(); }
function authHeaders() { const k = apiKey(); return k ? { Authorization: `Bearer ${k}` } : {}; }
function b64url(text) {
  const bytes = new TextEncoder().encode(text);
  let bin = ""; for (const b of bytes) bin += String.fromCharCode(b);
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

// ------------------------------------------------------------------ the socket

function connect() {
  if (state.open) return state.open;
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/ws`;
  const protocols = ["conduit"];
  if (apiKey()) protocols.push(`conduit.key.${b64url(apiKey())}`);  // browsers cannot send headers here
  state.open = new Promise((resolve, reject) => {
    const ws = new WebSocket(url, protocols);
    ws.onopen = () => { state.ws = ws; $("conn").textContent = "connected"; resolve(ws); };
    ws.onmessage = (ev) => onFrame(JSON.parse(ev.data));
    ws.onclose = () => {
      $("conn").textContent = "disconnected";
      state.ws = null; state.open = null;
      if (state.live) finish({ finish_reason: "error" }, "connection closed");
      reject(new Error("the WebSocket closed (wrong API key?)"));
    };
  });
  return state.open;
}

function onFrame(msg) {
  const live = state.live;
  if (!live || msg.id !== live.id) return;
  if (msg.type === "delta") {
    if (msg.reasoning_content) live.reasoning.textContent += msg.reasoning_content;
    if (msg.text) { live.text.textContent += msg.text; live.content += msg.text; }
    if (msg.tool_calls) {
      for (const c of msg.tool_calls) live.calls.textContent += `${c.function.name}(${c.function.arguments})\n`;
    }
    const n = (msg.token_ids || []).length;
    if (n) {
      if (live.first === null) live.first = performance.now();
      live.tokens += n;
      showSpeed(live);
    }
    $("transcript").scrollTop = $("transcript").scrollHeight;
  } else if (msg.type === "done") {
    finish(msg);
  } else if (msg.type === "error") {
    finish({ finish_reason: "error" }, msg.error.message);
  }
}

function showSpeed(live) {
  const secs = (performance.now() - live.first) / 1000;
  const rate = live.tokens > 1 && secs > 0 ? ((live.tokens - 1) / secs).toFixed(1) : "–";
  $("speed").textContent = `${live.tokens} tokens, ${rate} tokens/s`;
}

// ------------------------------------------------------------------ a turn

function bubble(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.innerHTML = '<span class="who"></span><div class="reasoning"></div><span class="text"></span><div class="calls"></div>';
  el.querySelector(".who").textContent = role;
  el.querySelector(".text").textContent = text || "";
  $("transcript").appendChild(el);
  return el;
}

function numberField(id) { const v = $(id).value.trim(); return v === "" ? undefined : Number(v); }

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.live) return;
  $("prompt").value = "";
  const messages = [];
  if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value.trim() });
  messages.push(...state.history, { role: "user", content: text });
  bubble("user", text);
  const el = bubble("assistant", "");
  el.dataset.testid = "answer";
  const request = { model: $("model").value || undefined, messages, max_tokens: numberField("max_tokens") };
  for (const k of ["temperature", "top_p"]) if (numberField(k) !== undefined) request[k] = numberField(k);
  if ($("ignore_eos").checked) request.ignore_eos = true;
  const id = `page-${Date.now().toString(36)}-${++state.seq}`;
  state.live = {
    id, user: text, el, content: "", tokens: 0, first: null,
    text: el.querySelector(".text"), reasoning: el.querySelector(".reasoning"), calls: el.querySelector(".calls"),
  };
  setBusy(true, "generating…");
  $("speed").textContent = "";
  try {
    const ws = await connect();
    ws.send(JSON.stringify({ type: "generate", id, endpoint: "chat", request }));
  } catch (err) {
    finish({ finish_reason: "error" }, err.message);
  }
}

function stop() {
  if (state.live && state.ws) state.ws.send(JSON.stringify({ type: "abort", id: state.live.id }));
}

function finish(done, error) {
  const live = state.live;
  if (!live) return;
  state.live = null;
  if (error) {
    live.el.classList.add("error");
    live.text.textContent += (live.content ? "\n" : "") + error;
  } else {
    state.history.push({ role: "user", content: live.user }, { role: "assistant", content: live.content });
  }
  const reason = done.finish_reason === "abort" ? "stopped" : done.finish_reason;
  setBusy(false, `finished: ${reason}` + (done.usage ? `, ${done.usage.completion_tokens} tokens` : ""));
  live.el.dataset.finish = reason;
}

function setBusy(busy, status) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("status").textContent = status;
}

// ------------------------------------------------------------------ models and metrics

async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: authHeaders() });
    if (!r.ok) throw new Error(`${r.status}`);
    const body = await r.json();
    const select = $("model");
    select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
  } catch (err) {
    $("conn").textContent = `models: ${err.message === "401" ? "API key needed" : err.message}`;
  }
}

function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const i = line.lastIndexOf(" ");
    out[line.slice(0, i)] = Number(line.slice(i + 1));
  }
  return out;
}

async function pollMetrics() {
  try {
    const r = await fetch("/metrics", { headers: authHeaders() });
    if (!r.ok) throw new Error(`${r.status}`);
    const m = parseMetrics(await r.text());
    const now = performance.now();
    // every streamed token is one observation of TTFT (the first) or of the inter-token latency
    const tokens = (m.conduit_time_to_first_token_seconds_count || 0) + (m.conduit_inter_token_latency_seconds_count || 0);
    $("m-running").textContent = m.conduit_num_requests_running ?? "–";
    $("m-waiting").textContent = m.conduit_num_requests_waiting ?? "–";
    $("m-kv").textContent = m.conduit_kv_cache_usage_ratio !== undefined ? `${(100 * m.conduit_kv_cache_usage_ratio).toFixed(1)} %` : "–";
    $("m-cache").textContent = m.conduit_prefix_cache_hit_rate !== undefined ? `${(100 * m.conduit_prefix_cache_hit_rate).toFixed(0)} %` : "–";
    $("m-health").textContent = m.conduit_healthy === 1 ? "ok" : "unhealthy";
    if (state.last) {
      const rate = (tokens - state.last.tokens) / ((now - state.last.at) / 1000);
      $("m-throughput").textContent = rate.toFixed(1);
    }
    state.last = { tokens, at: now };
  } catch (err) {
    $("m-health").textContent = err.message === "401" ? "API key needed" : "unreachable";
  }
}

// ------------------------------------------------------------------ wiring

window.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = localStorage.getItem("conduit-api-key") || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem("conduit-api-key", apiKey());
    if (state.ws) state.ws.close();
    loadModels();
  });
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => { state.history = []; $("transcript").replaceChildren(); });
  loadModels();
  pollMetrics();
  setInterval(pollMetrics, 1000);
});
