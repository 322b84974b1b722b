// The live page of `pdm run serve` (Week 4 Day 3): a chat box, and the engine as it runs.
//
// Two streams come from the server, both read with fetch() and a ReadableStream, both as
// server-sent events ("data: ...", then a blank line):
//   POST /v1/chat/completions with stream: true   the answer, a few characters at a time
//   GET /events                                   a snapshot of the engine whenever it changes
// The snapshots are made in the engine process (live_view.EngineWatch, whose `snapshot`
// lists their fields); this page only draws the latest one. Every value from the server goes
// into the page as text (textContent), never as HTML.
//
// The page itself may hold a snapshot: the server writes the engine's latest one into
// <script id="first-snapshot" type="application/json"> (null with --api-key: the page holds no
// data until the key is given), and this page draws it at once, before /events answers, so
// that even a page that never runs long enough to connect (a headless screenshot) shows the
// engine.

"use strict";

const page = {
  key: null, // the API key, when the server needs one (sent as "Authorization: Bearer <key>")
  model: null, // a promise of the served model's name, from GET /v1/models
  history: [], // the conversation answered so far: {role, content} messages
  latest: null, // the latest snapshot of the engine
  paused: false, // the view holds still (snapshots are still read, and kept in `latest`)
};

// --- server-sent events over fetch ------------------------------------------------------------

// The data of each event of a streamed response, as text, until the stream ends.
async function* serverSentData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:")) // ":..." lines are comments (keep-alive)
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data) yield data;
    }
  }
}

function authHeaders() {
  return page.key ? { Authorization: `Bearer ${page.key}` } : {};
}

// An element with attributes (class, data-*, title, ...) and children (elements or text).
function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

// Each request's own color, the same in the slots, the passes and the queue.
function requestColor(id) {
  return `hsl(${(id * 137) % 360} 65% 58%)`;
}

function swatch(id) {
  const node = el("span", { class: "swatch" });
  node.style.background = requestColor(id);
  return node;
}

// --- the chat ---------------------------------------------------------------------------------

async function loadModel() {
  const response = await fetch("/v1/models", { headers: authHeaders() });
  if (response.status === 401) throw new Error("wrong API key");
  if (!response.ok) throw new Error(`GET /v1/models: HTTP ${response.status}`);
  const name = (await response.json()).data[0].id;
  document.getElementById("model").textContent = name;
  return name;
}

function addMessage(role, text) {
  const node = el("div", { class: `message ${role}` }, el("span", { class: "text" }, text));
  const messages = document.getElementById("messages");
  messages.append(node);
  messages.scrollTop = messages.scrollHeight;
  return node;
}

// One question, streamed into its own answer. Several may run at once: each is a request of
// its own, sent with the turns answered so far.
async function send(question, maxTokens, temperature) {
  const messages = [...page.history, { role: "user", content: question }];
  addMessage("user", question);
  const answer = addMessage("answer", "");
  const text = answer.querySelector(".text");
  const stop = new AbortController();
  const stopButton = el("button", { type: "button", class: "stop" }, "stop");
  stopButton.onclick = () => stop.abort(); // the server aborts the request: watch its pages
  answer.append(stopButton);
  answer.classList.add("streaming");
  let note = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({
        model: await page.model,
        messages,
        stream: true,
        max_tokens: maxTokens,
        temperature,
      }),
      signal: stop.signal,
    });
    if (!response.ok) throw new Error((await response.json()).error.message);
    for await (const data of serverSentData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      text.textContent += choice.delta.content ?? "";
      if (choice.finish_reason) note = `finish: ${choice.finish_reason}`;
    }
    page.history.push(messages.at(-1), { role: "assistant", content: text.textContent });
  } catch (error) {
    note = error.name === "AbortError" ? "stopped" : `error: ${error.message}`;
    answer.classList.add(error.name === "AbortError" ? "stopped" : "failed");
  } finally {
    stopButton.remove();
    answer.classList.remove("streaming");
    answer.append(el("span", { class: "note" }, note));
    answer.dataset.done = "true";
  }
}

// The temperature control's value, 0 to 2; 0 (greedy: the likeliest token each time) when it
// is empty or not a number. Sent with every request: the API's default is 1 (OpenAI's).
function temperature() {
  const value = document.getElementById("temperature").valueAsNumber;
  return Number.isFinite(value) ? Math.min(2, Math.max(0, value)) : 0;
}

function setUpChat() {
  const form = document.getElementById("chat-form");
  const prompt = document.getElementById("prompt");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const question = prompt.value.trim();
    if (!question) return;
    prompt.value = "";
    send(question, Number(document.getElementById("max-tokens").value) || 128, temperature());
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
  });
  document.getElementById("new-chat").onclick = () => {
    page.history = [];
    document.getElementById("messages").replaceChildren();
  };
}

// --- the engine, from GET /events -------------------------------------------------------------

function setConnection(text, kind) {
  const status = document.getElementById("connection");
  status.textContent = text;
  status.className = `status ${kind}`;
}

// Read snapshots until the stream ends, then try again every two seconds.
async function watch() {
  for (;;) {
    try {
      const response = await fetch("/events", { headers: authHeaders() });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      setConnection("live", "live");
      for await (const data of serverSentData(response)) {
        page.latest = JSON.parse(data);
        if (!page.paused) draw(page.latest);
      }
      setConnection("the server stopped; retrying", "down");
    } catch (error) {
      setConnection(`disconnected (${error.message}); retrying`, "down");
    }
    await new Promise((resume) => setTimeout(resume, 2000));
  }
}

function setUpPause() {
  const button = document.getElementById("pause");
  button.onclick = () => {
    page.paused = !page.paused;
    button.textContent = page.paused ? "resume" : "pause";
    if (!page.paused && page.latest) draw(page.latest);
  };
}

function draw(snapshot) {
  drawConfig(snapshot);
  drawSlots(snapshot);
  drawQueue(snapshot.queue);
  drawPasses(snapshot);
  drawPages(snapshot.pages);
  drawCounters(snapshot);
  drawEvents(snapshot.events);
}

function drawConfig({ config }) {
  const parts = [
    `${config.policy} policy`,
    `${config.batch_size} decode slots`,
    config.policy === "hybrid"
      ? `budget ${config.budget} rows a pass`
      : `prompt chunks of up to ${config.budget} tokens`,
    `context ${config.max_seq_len} tokens`,
  ];
  if (config.speculative) parts.push("speculative decoding");
  document.getElementById("config").textContent = parts.join(" · ");
}

// A bar filled to done / total, with a caption.
function progress(done, total, caption) {
  const fill = el("span", { class: "fill" });
  fill.style.width = total ? `${Math.min(100, (100 * done) / total)}%` : "0";
  return el("div", { class: "progress" }, el("span", { class: "track" }, fill), caption);
}

// Prefilling: its offset among the tokens to prefill; decoding: its tokens so far. "cached":
// prompt tokens its first admission found in the prefix cache.
function requestProgress(r) {
  const cached = r.cached ? ` (${r.cached} cached)` : "";
  if (r.state === "prefilling") {
    return progress(r.offset, r.prefill, `offset ${r.offset}/${r.prefill}${cached}`);
  }
  const of = r.max_tokens ? `/${r.max_tokens}` : "";
  return progress(r.generated, r.max_tokens ?? r.generated, `${r.generated}${of} tokens${cached}`);
}

// A row of the slots table: the slot's number, its request (or "free"), state and progress.
function slotRow(slot, r) {
  if (r === null) {
    const free = el("span", { class: "state free" }, "free");
    return el("tr", { "data-state": "free" }, el("td", {}, slot), el("td", {}, "-"),
      el("td", {}, free), el("td"));
  }
  return el("tr", { "data-state": r.state }, el("td", {}, slot),
    el("td", {}, swatch(r.id), `request ${r.id}`),
    el("td", {}, el("span", { class: `state ${r.state}` }, r.state)),
    el("td", {}, requestProgress(r)));
}

function drawSlots({ slots, outside }) {
  const rows = slots.map((r, i) => slotRow(`${i}`, r));
  // the alternate policy prefills a prompt before it takes a slot
  if (outside !== null) rows.push(slotRow("(none yet)", outside));
  document.querySelector("#slots tbody").replaceChildren(...rows);
}

function drawQueue(queue) {
  const items = queue.map((r) => {
    let what = `${r.prompt}-token prompt`;
    if (r.state === "preempted") what = `preempted: ${r.prefill} tokens to prefill again`;
    if (r.for_pages) what += ", waits for free pages";
    return el("li", { "data-state": r.state }, swatch(r.id), `request ${r.id} `,
      el("span", { class: `state ${r.state}` }, r.state), ` ${what}`);
  });
  if (!items.length) items.push(el("li", { class: "muted" }, "empty"));
  document.getElementById("queue").replaceChildren(...items);
}

// One row per forward pass, newest first: a bar of its rows, decode rows first, then each
// prompt chunk (in its request's color), then padding, against the pass's budget (all bars
// are drawn to one scale).
function drawPasses({ passes }) {
  const rows = (p) => p.decode + p.chunks.reduce((sum, [, tokens]) => sum + tokens, 0);
  const scale = Math.max(...passes.map((p) => Math.max(p.budget, rows(p) + p.padding)));
  const segment = (kind, size, label, color) => {
    const node = el("span", { class: `seg ${kind}`, title: label });
    node.style.width = `${(100 * size) / scale}%`;
    if (color) node.style.background = color;
    return node;
  };
  const items = [...passes].reverse().map((p) => {
    const bar = el("div", { class: "bar" });
    const words = [];
    if (p.decode) {
      bar.append(segment("decode", p.decode, `${p.decode} decode rows`));
      words.push(`decode ${p.decode}`);
    }
    for (const [id, tokens] of p.chunks) {
      bar.append(segment("chunk", tokens, `request ${id}: ${tokens} prompt tokens`, requestColor(id)));
      words.push(`req ${id} (${tokens})`);
    }
    if (p.padding) {
      bar.append(segment("padding", p.padding, `${p.padding} padding rows`));
      words.push(`pad ${p.padding}`);
    }
    const used = rows(p) + p.padding;
    if (used < p.budget) bar.append(segment("free", p.budget - used, "budget left"));
    const sum = `${used}/${p.budget}: ${words.join(" + ")}`;
    return el("div", { class: "pass" }, el("span", { class: "number" }, `#${p.n}`), bar,
      el("span", { class: "sum", title: sum }, sum));
  });
  if (!items.length) items.push(el("p", { class: "muted" }, "no pass yet: send a message"));
  document.getElementById("passes").replaceChildren(...items);
}

function drawPages(pages) {
  const box = document.getElementById("pages");
  if (pages === null) {
    box.replaceChildren(el("p", { class: "muted" },
      "dense KV caches: no page pool (start serve with --max-pages N for one)"));
    return;
  }
  const size = `pages of ${pages.page_size} tokens`;
  if (pages.total === null) {
    box.replaceChildren(el("p", {},
      `unbounded pool: ${pages.in_use} in use, ${pages.cached} cached (${size})`));
    return;
  }
  // in use: held by requests; cached: held by no one, kept for the prefix cache; free
  const bar = el("div", { class: "bar" });
  const words = el("p", { class: "sum" });
  for (const kind of ["in_use", "cached", "free"]) {
    const name = `${pages[kind]} ${kind.replace("_", " ")}`;
    const node = el("span", { class: `seg ${kind}`, title: name });
    node.style.width = `${(100 * pages[kind]) / pages.total}%`;
    bar.append(node);
    words.append(el("span", { class: `seg key ${kind}` }), name);
  }
  words.append(` (of ${pages.total} ${size})`);
  box.replaceChildren(bar, words);
}

const COUNTERS = {
  running: "requests running",
  waiting: "requests waiting",
  prompt_tokens_prefilled: "prompt tokens prefilled",
  prompt_tokens_cached: "prompt tokens from the prefix cache",
  tokens_decoded: "tokens decoded",
  tokens_proposed: "tokens proposed (speculative)",
  tokens_accepted: "tokens accepted (speculative)",
  preemptions: "preemptions",
  requests_finished: "requests finished",
  requests_aborted: "requests aborted",
};

const SPECULATIVE = ["tokens_proposed", "tokens_accepted"]; // shown only with speculation

function drawCounters({ stats, config }) {
  const items = Object.entries(COUNTERS)
    .filter(([key]) => key in stats && (config.speculative || !SPECULATIVE.includes(key)))
    .flatMap(([key, label]) => [el("dt", {}, label), el("dd", {}, `${stats[key]}`)]);
  document.getElementById("counters").replaceChildren(...items);
}

function eventText(e) {
  const who = `request ${e.request}`;
  switch (e.kind) {
    case "admit":
      return `${who} admitted` + (e.tokens ? `: ${e.tokens} prompt tokens from the prefix cache` : "");
    case "wait":
      return `${who} waits for free pages`;
    case "preempt":
      return `${who} preempted: its pages go back, it will prefill again`;
    case "refuse":
      return `${who} refused: ${e.detail}`;
    case "finish":
      return `${who} finished: ${e.generated} tokens`;
    case "abort":
      return `${who} aborted: its client left`;
    default:
      return `${who}: ${e.kind}`;
  }
}

function drawEvents(events) {
  const items = [...events].reverse().map((e) =>
    el("li", { class: e.kind }, e.request === null ? "" : swatch(e.request), eventText(e)));
  document.getElementById("events").replaceChildren(...items);
}

// --- start ------------------------------------------------------------------------------------

// The snapshot the server wrote into the page, drawn at once (nothing when it is null).
function drawFirstSnapshot() {
  const element = document.getElementById("first-snapshot");
  if (element === null) return;
  try {
    const snapshot = JSON.parse(element.textContent);
    if (snapshot === null) return;
    page.latest = snapshot;
    draw(snapshot);
  } catch (error) {
    console.error(`the page's first snapshot: ${error.message}`); // /events draws the next one
  }
}

let watching = false;

function connect() {
  page.model = loadModel();
  page.model.catch((error) => askForKey(error.message));
  if (!watching) {
    watching = true;
    watch();
  }
}

// With --api-key the page asks for the key once, and keeps it for this tab (sessionStorage).
function askForKey(problem) {
  const form = document.getElementById("key-form");
  document.getElementById("key-problem").textContent = problem;
  form.hidden = false;
  form.onsubmit = (event) => {
    event.preventDefault();
    page.key = document.getElementById("api-key").value;
    sessionStorage.setItem("tiny-llm-api-key", page.key);
    form.hidden = true;
    connect();
  };
}

setUpChat();
setUpPause();
drawFirstSnapshot();
page.key = sessionStorage.getItem("tiny-llm-api-key");
const needsKey = document.querySelector('meta[name="api-key"]').content === "required";
if (needsKey && !page.key) askForKey("");
else connect();
