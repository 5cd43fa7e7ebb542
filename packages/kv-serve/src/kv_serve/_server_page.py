"""The page ``GET /`` serves: a chat with the model and a live view of the engine's pool.

One self-contained HTML document (inline CSS and JavaScript, no build step, nothing fetched
from elsewhere: the machines it runs on may have no internet). The chat streams
``/v1/chat/completions`` (or ``/v1/completions`` for a model without a chat template) and
shows tool calls as they arrive; the pool view polls ``GET /status``
(:func:`status_payload`), the same numbers ``/metrics`` exposes, as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.responses import HTMLResponse, JSONResponse, Response

from ._server_metrics import ServerMetrics
from ._server_worker import EngineWorker, WorkerSnapshot

__all__ = ["PAGE_HTML", "PageEndpoints", "status_payload"]


def status_payload(
    *,
    model: str,
    chat: bool,
    snapshot: WorkerSnapshot,
    prompt_tokens: int,
    generation_tokens: int,
) -> dict[str, Any]:
    """What the page's pool view shows: the engine's state now and the server's counters."""
    sub_pools = [
        {
            "name": name,
            "used": snapshot.pages_used.get(name, 0),
            "total": total,
            "kv_bits": snapshot.kv_bits.get(name, 0),
        }
        for name, total in snapshot.pages_total.items()
    ]
    return {
        "model": model,
        "chat": chat,
        "alive": snapshot.alive,
        "sub_pools": sub_pools,
        "counters": {
            "running": snapshot.running,
            "queued": snapshot.queued,
            "steps": snapshot.steps,
            "prompt_tokens": prompt_tokens,
            "generation_tokens": generation_tokens,
            "prefill_tokens": snapshot.prefill_tokens,
            "decode_tokens": snapshot.decode_tokens,
            "prefix_hit_tokens": snapshot.prefix_hit_tokens,
            "prefix_cached_pages": snapshot.prefix_cached_pages,
            "prefix_evictions": snapshot.prefix_evictions,
            "state_bytes": snapshot.state_bytes,
            "state_snapshots": snapshot.state_snapshots,
            "state_snapshot_bytes": snapshot.state_snapshot_bytes,
            "state_snapshot_hits": snapshot.state_snapshot_hits,
            "preemptions": snapshot.preemptions,
            "errors": snapshot.errors,
        },
    }


@dataclass
class PageEndpoints:
    """``GET /`` (the page) and ``GET /status`` (what it polls)."""

    model_name: str
    tokenizer: Any
    worker: EngineWorker
    metrics: ServerMetrics

    async def page(self) -> Response:
        """The page."""
        return HTMLResponse(PAGE_HTML)

    async def status(self) -> Response:
        """The engine's state and the server's counters, as JSON."""
        return JSONResponse(
            status_payload(
                model=self.model_name,
                chat=bool(getattr(self.tokenizer, "chat_template", None)),
                snapshot=self.worker.snapshot(),
                prompt_tokens=self.metrics.prompt_tokens,
                generation_tokens=self.metrics.generation_tokens,
            )
        )


PAGE_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kv-serve</title>
<style>
  :root { --fg: #1d232a; --muted: #6b7480; --line: #d9dee4; --accent: #2f6fdd;
          --bg: #f6f7f9; --card: #ffffff; --tool: #fff6e0; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.45 system-ui, sans-serif; color: var(--fg);
         background: var(--bg); }
  header { padding: 10px 18px; background: var(--card); border-bottom: 1px solid var(--line);
           display: flex; gap: 14px; align-items: baseline; }
  header h1 { font-size: 17px; margin: 0; }
  header span { color: var(--muted); }
  main { display: grid; grid-template-columns: minmax(0, 3fr) minmax(260px, 2fr); gap: 14px;
         padding: 14px 18px; }
  section { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
            padding: 12px; }
  h2 { font-size: 14px; margin: 0 0 8px; }
  #messages { height: 420px; overflow-y: auto; display: flex; flex-direction: column;
              gap: 8px; padding: 4px; }
  .msg { padding: 8px 10px; border-radius: 8px; white-space: pre-wrap;
         overflow-wrap: anywhere; }
  .user { background: #e7effc; align-self: flex-end; max-width: 85%; }
  .assistant { background: #eef1f4; align-self: flex-start; max-width: 85%; }
  .assistant.error { background: #fde8e8; color: #8a1c1c; }
  .tool { background: var(--tool); border: 1px solid #f0d58a; border-radius: 6px;
          font-family: ui-monospace, monospace; font-size: 12px; margin-top: 6px;
          padding: 6px; }
  form { display: flex; gap: 8px; margin-top: 10px; }
  textarea { flex: 1; min-height: 54px; resize: vertical; font: inherit; padding: 6px; }
  button { background: var(--accent); color: #fff; border: 0; border-radius: 6px;
           padding: 0 16px; font: inherit; cursor: pointer; }
  button:disabled { opacity: .5; cursor: default; }
  .options { display: flex; gap: 12px; flex-wrap: wrap; color: var(--muted);
             margin-top: 6px; }
  .options input[type=number] { width: 70px; }
  table { width: 100%; border-collapse: collapse; }
  td { padding: 3px 4px; border-bottom: 1px solid var(--line); }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .bar { height: 8px; background: var(--line); border-radius: 4px; overflow: hidden; }
  .bar > div { height: 100%; background: var(--accent); width: 0; }
  .pool { margin-bottom: 10px; }
  .pool .label { display: flex; justify-content: space-between; color: var(--muted); }
</style>
</head>
<body>
<header>
  <h1>kv-serve</h1>
  <span id="model">model: ...</span>
  <span id="mode"></span>
  <span id="alive"></span>
</header>
<main>
  <section>
    <h2>Chat</h2>
    <div id="messages"></div>
    <form id="chat-form">
      <textarea id="prompt" placeholder="Write a message"></textarea>
      <button id="send" type="submit">Send</button>
    </form>
    <div class="options">
      <label>max tokens <input id="max-tokens" type="number" min="1" value="64"></label>
      <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1"
             value="0"></label>
      <label><input id="offer-tool" type="checkbox"> offer a tool (get_weather)</label>
      <label>tool choice <select id="tool-choice">
        <option value="auto">auto</option><option value="required">required</option>
      </select></label>
      <button id="clear" type="button">Clear</button>
    </div>
  </section>
  <section>
    <h2>Pool</h2>
    <div id="pools"></div>
    <table id="counters"></table>
  </section>
</main>
<script>
"use strict";
const COUNTERS = [
  ["running", "requests running"], ["queued", "requests queued"],
  ["steps", "engine steps"], ["prompt_tokens", "prompt tokens"],
  ["generation_tokens", "generated tokens"], ["prefill_tokens", "tokens prefilled"],
  ["decode_tokens", "tokens decoded"], ["prefix_hit_tokens", "prefix-cache hit tokens"],
  ["prefix_cached_pages", "cached prefix pages"], ["prefix_evictions", "prefix evictions"],
  ["state_bytes", "recurrent state bytes"], ["state_snapshots", "state snapshots"],
  ["state_snapshot_bytes", "state snapshot bytes"],
  ["state_snapshot_hits", "state snapshot hits"], ["preemptions", "preemptions"],
  ["errors", "errors"],
];
const TOOL = {type: "function", function: {
  name: "get_weather", description: "The weather in a city now.",
  parameters: {type: "object", properties: {city: {type: "string", maxLength: 24}},
               required: ["city"]}}};
let chatMode = true;
let modelName = "";
let history = [];

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function buildCounters() {
  const table = document.getElementById("counters");
  for (const [key, label] of COUNTERS) {
    const row = table.insertRow();
    row.insertCell().textContent = label;
    const cell = row.insertCell();
    cell.className = "num";
    cell.id = "stat-" + key;
    cell.textContent = "0";
  }
}

function renderPools(pools) {
  const box = document.getElementById("pools");
  box.replaceChildren();
  if (!pools.length) box.appendChild(el("div", "pool", "no attention sub-pools"));
  for (const pool of pools) {
    const div = el("div", "pool");
    div.id = "pool-" + pool.name;
    const label = el("div", "label");
    const bits = pool.kv_bits ? ", " + pool.kv_bits + "-bit" : "";
    label.appendChild(el("span", "", pool.name + bits));
    const count = el("span", "pages", pool.used + " / " + pool.total + " pages");
    label.appendChild(count);
    const bar = el("div", "bar");
    const fill = el("div");
    fill.style.width = (pool.total ? 100 * pool.used / pool.total : 0) + "%";
    bar.appendChild(fill);
    div.append(label, bar);
    box.appendChild(div);
  }
}

async function poll() {
  try {
    const reply = await fetch("/status", {cache: "no-store"});
    const status = await reply.json();
    modelName = status.model;
    document.getElementById("model").textContent = "model: " + status.model;
    chatMode = status.chat;
    document.getElementById("mode").textContent =
      status.chat ? "chat template: yes" : "no chat template: plain completion";
    document.getElementById("alive").textContent = status.alive ? "" : "engine stopped";
    renderPools(status.sub_pools);
    for (const [key] of COUNTERS) {
      document.getElementById("stat-" + key).textContent = status.counters[key];
    }
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (error) {
    document.getElementById("alive").textContent = "server unreachable";
  }
}

function showToolCalls(box, calls) {
  box.querySelectorAll(".tool").forEach((node) => node.remove());
  for (const call of calls) {
    if (!call) continue;
    box.appendChild(el("div", "tool",
      "tool call " + (call.name || "?") + "(" + (call.arguments || "") + ")"));
  }
}

async function send(text) {
  const button = document.getElementById("send");
  button.disabled = true;
  const messages = document.getElementById("messages");
  messages.appendChild(el("div", "msg user", text));
  const box = el("div", "msg assistant");
  box.dataset.chunks = "0";
  box.dataset.done = "false";
  const body = el("span", "text");
  box.appendChild(body);
  messages.appendChild(box);
  const maxTokens = Number(document.getElementById("max-tokens").value) || 64;
  const temperature = Number(document.getElementById("temperature").value) || 0;
  const request = {model: modelName, max_tokens: maxTokens, temperature: temperature,
                   stream: true};
  let url = "/v1/completions";
  if (chatMode) {
    history.push({role: "user", content: text});
    request.messages = history;
    if (document.getElementById("offer-tool").checked) {
      request.tools = [TOOL];
      request.tool_choice = document.getElementById("tool-choice").value;
    }
    url = "/v1/chat/completions";
  } else {
    request.prompt = text;
  }
  const calls = [];
  let answer = "";
  try {
    const reply = await fetch(url, {method: "POST", body: JSON.stringify(request),
                                    headers: {"Content-Type": "application/json"}});
    if (!reply.ok) {
      const error = await reply.json();
      throw new Error(error.error ? error.error.message : reply.statusText);
    }
    const reader = reply.body.getReader();
    const decoder = new TextDecoder();
    let pending = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      pending += decoder.decode(value, {stream: true});
      const lines = pending.split("\\n");
      pending = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const event = JSON.parse(line.slice(6));
        if (event.error) throw new Error(event.error.message);
        const choice = (event.choices || [])[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        const piece = chatMode ? (delta.content || "") : (choice.text || "");
        for (const call of delta.tool_calls || []) {
          const slot = calls[call.index] || (calls[call.index] = {name: "", arguments: ""});
          if (call.function && call.function.name) slot.name += call.function.name;
          if (call.function && call.function.arguments) {
            slot.arguments += call.function.arguments;
          }
        }
        answer += piece;
        body.textContent = answer;
        showToolCalls(box, calls);
        box.dataset.chunks = String(Number(box.dataset.chunks) + 1);
        messages.scrollTop = messages.scrollHeight;
      }
    }
    if (chatMode) {
      const turn = {role: "assistant", content: answer};
      if (calls.length) {
        turn.tool_calls = calls.map((call, i) => ({id: "call_" + i, type: "function",
          function: {name: call.name, arguments: call.arguments}}));
      }
      history.push(turn);
    }
  } catch (error) {
    box.classList.add("error");
    body.textContent = (answer ? answer + "\\n" : "") + "error: " + error.message;
    if (chatMode) history.pop();
  } finally {
    box.dataset.done = "true";
    button.disabled = false;
    poll();
  }
}

document.getElementById("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = document.getElementById("prompt");
  const text = prompt.value.trim();
  if (!text) return;
  prompt.value = "";
  send(text);
});
document.getElementById("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    document.getElementById("chat-form").requestSubmit();
  }
});
document.getElementById("clear").addEventListener("click", () => {
  history = [];
  document.getElementById("messages").replaceChildren();
});
buildCounters();
poll();
setInterval(poll, 500);
</script>
</body>
</html>
"""
