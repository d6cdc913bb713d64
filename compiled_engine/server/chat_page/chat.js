// The chat page: talks to this server's /v1/chat/completions, streamed. Model output is always
// inserted as text (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = { chat: "compiled_engine.chat", settings: "compiled_engine.settings", key: "compiled_engine.api_key" };
const FIELDS = ["system", "temperature", "top-p", "max-tokens", "seed"];

let conversation = load(STORE.chat, []);
let controller = null;

function load(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value === null ? fallback : value;
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE.chat, JSON.stringify(conversation));
  const settings = {};
  for (const id of FIELDS) settings[id] = $(id).value;
  localStorage.setItem(STORE.settings, JSON.stringify(settings));
  localStorage.setItem(STORE.key, $("api-key").value);
}

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) result.Authorization = "Bearer " + key;
  return result;
}

// Text with ``` fences: the fenced parts become preformatted blocks with a copy button.
function renderContent(element, text) {
  element.replaceChildren();
  const parts = text.split("```");
  parts.forEach((part, i) => {
    if (i % 2 === 0) {
      if (part) element.append(document.createTextNode(part));
      return;
    }
    const newline = part.indexOf("\n");
    const code = newline >= 0 ? part.slice(newline + 1) : part;  // drop the language tag
    const block = document.createElement("div");
    block.className = "code";
    const pre = document.createElement("pre");
    const inner = document.createElement("code");
    inner.textContent = code;
    pre.append(inner);
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => navigator.clipboard?.writeText(code).then(() => (copy.textContent = "Copied")));
    block.append(copy, pre);
    element.append(block);
  });
}

function messageElement(turn) {
  const element = document.createElement("div");
  element.className = "message " + turn.role;
  const role = document.createElement("span");
  role.className = "role";
  role.textContent = turn.role;
  const body = document.createElement("div");
  body.className = "content";
  renderContent(body, turn.content);
  element.append(role, body);
  return element;
}

function render() {
  $("messages").replaceChildren(...conversation.map(messageElement));
  $("messages").scrollTop = $("messages").scrollHeight;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function errorText(status, body) {
  const message = body && body.error && body.error.message ? body.error.message : "";
  if (status === 401) return "The server needs an API key (401): enter it in the API key field. " + message;
  if (status === 429) return "The server is busy (429): try again in a moment. " + message;
  if (body && body.error && body.error.code === "context_length_exceeded") return "The conversation is too long for the model: " + message;
  return `Error ${status}: ${message || "the request failed"}`;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const turn of conversation) messages.push({ role: turn.role, content: turn.content });
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  return body;
}

async function send(event) {
  event.preventDefault();
  const text = $("input").value;
  if (!text.trim() || controller) return;
  showError("");
  $("stats").textContent = "";
  conversation.push({ role: "user", content: text });
  $("input").value = "";
  const body = requestBody();
  const reply = { role: "assistant", content: "" };
  conversation.push(reply);
  render();
  const content = $("messages").lastChild.querySelector(".content");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  let stopped = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      const problem = await response.json().catch(() => null);
      conversation.splice(-2, 2);  // no reply: the message goes back to the input, to send again
      $("input").value = text;
      render();
      showError(errorText(response.status, problem));
      return;
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const lines = buffer.split("\n");
      buffer = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) showError("The reply stopped: " + chunk.error.message); // a failure after the first token
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (firstToken === null) firstToken = performance.now();
          reply.content += delta.content;
          renderContent(content, reply.content);
          $("messages").scrollTop = $("messages").scrollHeight;
        }
      }
    }
  } catch (error) {
    if (error.name === "AbortError") stopped = true;
    else showError("The connection failed: " + error.message);
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    save();
    showStats(started, firstToken, usage, stopped, reply);
  }
}

function showStats(started, firstToken, usage, stopped, reply) {
  if (firstToken === null && !usage) {
    if (stopped) $("stats").textContent = "stopped";
    return;
  }
  const seconds = (performance.now() - (firstToken || started)) / 1000;
  const tokens = usage ? usage.completion_tokens : null;
  const parts = [];
  if (tokens !== null) parts.push(`${tokens} tokens`);
  if (firstToken !== null) parts.push(`time to first token ${Math.round(firstToken - started)} ms`);
  if (tokens !== null && seconds > 0) parts.push(`${(tokens / seconds).toFixed(1)} tokens/s`);
  if (usage && usage.prompt_tokens_details) parts.push(`${usage.prompt_tokens_details.cached_tokens} cached prompt tokens`);
  if (stopped) parts.push("stopped");
  $("stats").textContent = parts.join(" · ");
  reply.stats = $("stats").textContent;
}

async function loadModels() {
  const select = $("model");
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) return;  // without the key: the default model until one is entered
    const models = await response.json();
    const current = select.value;
    select.replaceChildren();
    for (const model of models.data) {
      const option = document.createElement("option");
      option.value = model.id;
      option.textContent = model.parent ? `${model.id} (adapter)` : model.id;
      select.append(option);
    }
    if (current) select.value = current;
  } catch {
    // the status strip shows when the server cannot be reached
  }
}

// Running and waiting requests and KV pages in use, from /metrics.
async function refreshStatus() {
  try {
    const text = await (await fetch("/metrics")).text();
    const value = (name) => {
      const line = text.split("\n").find((l) => l.startsWith(name + " "));
      return line ? Math.round(Number(line.split(" ")[1])) : 0;
    };
    const used = value("compiled_engine_kv_pages_used");
    const total = used + value("compiled_engine_kv_pages_free");
    $("status").textContent =
      `running ${value("compiled_engine_running_requests")} · waiting ${value("compiled_engine_waiting_requests")} · KV pages ${used} / ${total}`;
  } catch {
    $("status").textContent = "server unreachable";
  }
}

function start() {
  const settings = load(STORE.settings, {});
  for (const id of FIELDS) if (settings[id] !== undefined) $(id).value = settings[id];
  $("api-key").value = localStorage.getItem(STORE.key) || "";
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) send(event);
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => {
    conversation = [];
    save();
    render();
    showError("");
    $("stats").textContent = "";
  });
  $("api-key").addEventListener("change", () => {
    save();
    loadModels();
  });
  for (const id of FIELDS) $(id).addEventListener("change", save);
  render();
  loadModels();
  refreshStatus();
  setInterval(refreshStatus, 2000);
}

start();
