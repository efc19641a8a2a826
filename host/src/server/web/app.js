// The playground: streams chat answers from /v1/chat/completions, lists
// /v1/plugins, charts the gauges of /metrics. Only the public API is used;
// with --api-key every call carries the key the user typed (kept in this
// tab's sessionStorage).
"use strict";

const KEY = "host.apiKey";
const HISTORY = 60; // gauge samples kept (one a second)
const $ = (id) => document.getElementById(id);

const state = {
  model: null,
  messages: [], // the conversation sent with each request
  abort: null, // the running answer's AbortController
  gauges: { running: [], waiting: [], kv: [] },
};

class NeedKey extends Error {}

function authHeaders(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = sessionStorage.getItem(KEY);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// fetch with the key; a 401 opens the key form, other errors carry the
// server's message.
async function api(path, options = {}) {
  const r = await fetch(path, {
    ...options,
    headers: authHeaders(options.body !== undefined),
  });
  if (r.status === 401) {
    askKey(sessionStorage.getItem(KEY) ? "The API key was refused; enter the right one." : null);
    throw new NeedKey("this server requires an API key");
  }
  if (!r.ok) {
    let message = r.statusText;
    try {
      message = (await r.json()).error.message;
    } catch (_) {
      /* not an OpenAI error body */
    }
    throw new Error(`${r.status}: ${message}`);
  }
  return r;
}

function askKey(message) {
  if (message) $("key-message").textContent = message;
  $("key-form").hidden = false;
  $("api-key").focus();
  status("waiting for the API key");
}

function status(text) {
  $("status").textContent = text;
}

async function loadModel() {
  const models = await (await api("/v1/models")).json();
  const m = models.data[0];
  state.model = m.id;
  $("model").textContent = m.id;
  $("context").textContent = `context ${m.max_model_len} tokens`;
}

async function loadPlugins() {
  const list = (await (await api("/v1/plugins")).json()).data;
  const ul = $("plugins");
  ul.replaceChildren();
  for (const p of list) {
    const li = document.createElement("li");
    li.className = "plugin" + (p.used_as ? " used" : "");
    const name = document.createElement("code");
    name.textContent = p.version ? `${p.name}@${p.version}` : p.name;
    const kind = document.createElement("span");
    kind.className = "muted";
    kind.textContent = ` ${p.kind}` + (p.used_as ? ` · ${p.used_as}` : "");
    li.append(name, kind);
    ul.append(li);
  }
}

async function start() {
  try {
    await loadModel();
    $("key-form").hidden = true;
    status("ready");
    await loadPlugins();
  } catch (e) {
    if (!(e instanceof NeedKey)) status(`cannot reach the server: ${e.message}`);
  }
}

// ---- chat ----------------------------------------------------------------

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = role === "assistant" ? "answer" : "text";
  body.textContent = text;
  div.append(body);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function number(id, parse) {
  const v = parse($(id).value);
  return Number.isFinite(v) ? v : undefined;
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.messages);
  const body = {
    model: state.model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature", parseFloat),
    top_p: number("top_p", parseFloat),
    max_tokens: number("max_tokens", (s) => parseInt(s, 10)),
    seed: number("seed", (s) => parseInt(s, 10)),
  };
  for (const k of Object.keys(body)) if (body[k] === undefined) delete body[k];
  return body;
}

// Reads the server-sent events of `response`, calling `onData` with each
// parsed `data:` payload until `[DONE]`.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  bubble("user", text);
  const div = bubble("assistant", "");
  const answer = div.querySelector(".answer");
  const stats = document.createElement("div");
  stats.className = "stats muted";
  div.append(stats);

  state.abort = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  status("generating…");
  const t0 = performance.now();
  let tFirst = null;
  let content = "";
  let tokens = 0;
  let finish = null;
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST",
      body: JSON.stringify(requestBody()),
      signal: state.abort.signal,
    });
    await readEvents(r, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      for (const c of chunk.choices || []) {
        const piece = c.delta && c.delta.content;
        if (piece) {
          if (tFirst === null) tFirst = performance.now();
          content += piece;
          answer.textContent = content;
        }
        if (c.finish_reason) finish = c.finish_reason;
      }
    });
    const tEnd = performance.now();
    const ttft = (tFirst ?? tEnd) - t0;
    // Decode speed: the tokens after the first, over the time after it.
    const rate = tokens > 1 && tFirst !== null ? (tokens - 1) / ((tEnd - tFirst) / 1000) : tokens / ((tEnd - t0) / 1000);
    stats.dataset.ttftMs = ttft.toFixed(1);
    stats.dataset.tokensPerS = rate.toFixed(2);
    stats.textContent = `${tokens} tokens · TTFT ${ttft.toFixed(0)} ms · ${rate.toFixed(1)} tok/s · ${finish ?? "?"}`;
    state.messages.push({ role: "assistant", content });
    status("ready");
  } catch (e) {
    div.classList.add("error");
    stats.textContent = e.name === "AbortError" ? "stopped" : `error: ${e.message}`;
    if (content) state.messages.push({ role: "assistant", content });
    else state.messages.pop(); // the question goes unanswered: drop it
    status(e instanceof NeedKey ? "waiting for the API key" : "ready");
  } finally {
    div.dataset.done = "true";
    state.abort = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// ---- gauges ----------------------------------------------------------------

function metric(text, name) {
  for (const line of text.split("\n")) {
    if (line.startsWith(name + "{") || line.startsWith(name + " ")) {
      const v = parseFloat(line.slice(line.lastIndexOf(" ") + 1));
      if (Number.isFinite(v)) return v;
    }
  }
  return NaN;
}

function draw(canvas, values, max) {
  const ctx = canvas.getContext("2d");
  const { width: w, height: h } = canvas;
  ctx.clearRect(0, 0, w, h);
  if (values.length < 2) return;
  const step = w / (HISTORY - 1);
  const x0 = w - (values.length - 1) * step;
  ctx.beginPath();
  ctx.moveTo(x0, h);
  values.forEach((v, i) => ctx.lineTo(x0 + i * step, h - 2 - (v / max) * (h - 4)));
  ctx.lineTo(w, h);
  ctx.closePath();
  ctx.fillStyle = "rgba(74, 144, 226, 0.25)";
  ctx.fill();
  ctx.beginPath();
  values.forEach((v, i) => ctx.lineTo(x0 + i * step, h - 2 - (v / max) * (h - 4)));
  ctx.strokeStyle = "#4a90e2";
  ctx.lineWidth = 1.5;
  ctx.stroke();
}

async function poll() {
  try {
    const text = await (await api("/metrics")).text();
    const now = {
      running: metric(text, "vllm:num_requests_running"),
      waiting: metric(text, "vllm:num_requests_waiting"),
      kv: metric(text, "vllm:kv_cache_usage_perc"),
    };
    for (const k of Object.keys(now)) {
      const list = state.gauges[k];
      list.push(Number.isFinite(now[k]) ? now[k] : 0);
      if (list.length > HISTORY) list.shift();
    }
    $("g-running").textContent = now.running;
    $("g-waiting").textContent = now.waiting;
    $("g-kv").textContent = `${(now.kv * 100).toFixed(1)} %`;
    const countMax = Math.max(1, ...state.gauges.running, ...state.gauges.waiting);
    draw($("c-running"), state.gauges.running, countMax);
    draw($("c-waiting"), state.gauges.waiting, countMax);
    draw($("c-kv"), state.gauges.kv, 1);
  } catch (_) {
    /* the next poll tries again */
  }
}

// ---- wiring ----------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("api-key").value.trim());
    $("api-key").value = "";
    start();
  });
  $("prompt-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.abort) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("prompt-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("clear").addEventListener("click", () => {
    if (state.abort) state.abort.abort();
    state.messages = [];
    $("messages").replaceChildren();
  });
  start();
  poll();
  setInterval(poll, 1000);
});
