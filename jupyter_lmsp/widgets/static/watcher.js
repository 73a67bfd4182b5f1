// TaskWatcher view (anywidget ES module; no imports, no build step, nothing from a CDN).
// The kernel side follows the task's event log and sets the synced traits; this view draws
// them, ticks the elapsed time locally between updates, and sends {type: "cancel"}.
//
// When the kernel stops updating it (no heartbeat for STALE_MS: its server was killed and
// restarted, or the kernel died) while the task is not over, the view follows the task itself
// from the browser (BrowserFollower): the task's SSE stream from the last sequence number it
// shows, with `Last-Event-ID` on every reconnect, folded with the service's event -> state map
// (the `event_states` trait). It says "reconnecting", then "server unavailable", while the
// server is gone, and hands back to the kernel once the kernel catches up.

const STALE_MS = 4000;
// Consecutive failures after which "reconnecting" becomes "server unavailable".
const UNAVAILABLE_AFTER = 3;
const MAX_EVENTS = 8;

function h(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmtSeconds(s) {
  if (!(s >= 0)) return "–";
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  return `${m} min ${(s - 60 * m).toFixed(0)} s`;
}

// A structured output or a call's arguments, indented when they are whole JSON.
function pretty(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

// The words and colour class of a task's outcome, as the sidebar says them: a task that ended
// `completed` with an `incomplete` response is "incomplete: <reason>", a failed one names its
// code.
function outcome(state, status, reason, error) {
  if (state === "completed" && status === "incomplete") {
    return { word: reason ? `incomplete: ${reason}` : "incomplete", cls: "incomplete" };
  }
  if (state === "failed" && error && error.code) return { word: `failed: ${error.code}`, cls: "failed" };
  return { word: state || "starting", cls: state || "queued" };
}

// The page's Jupyter server (JupyterLab and Notebook 7 put it in #jupyter-config-data).
function serverConfig() {
  try {
    const node = document.getElementById("jupyter-config-data");
    const config = node ? JSON.parse(node.textContent || "{}") : {};
    return config.baseUrl ? { baseUrl: config.baseUrl, token: config.token || "" } : null;
  } catch {
    return null;
  }
}

function outputText(output) {
  let text = "";
  for (const item of output || []) {
    if (item.type !== "message") continue;
    for (const part of item.content || []) if (part.type === "output_text") text += part.text || "";
  }
  return text;
}

function detailOf(e) {
  if (typeof e.delta === "string") return JSON.stringify(e.delta.length <= 40 ? e.delta : `${e.delta.slice(0, 39)}…`);
  if (e.response) return e.response.error ? `${e.response.status}: ${e.response.error.code}` : e.response.status || "";
  if (typeof e.text === "string") return `${e.text.length} characters`;
  return "";
}

// Follows one task from the browser: `values` are the traits it overrides while active.
class BrowserFollower {
  constructor(model, onChange) {
    this.model = model;
    this.onChange = onChange;
    this.values = null;
    this.controller = null;
    this.failures = 0;
    this.stopped = true;
  }

  get active() {
    return !this.stopped;
  }

  start() {
    const config = serverConfig();
    if (!this.stopped) return;
    const get = (name) => this.model.get(name);
    this.values = {
      state: get("state"), status: get("status"), incomplete_reason: get("incomplete_reason"),
      error: get("error"), text: get("text"), last_sequence_number: get("last_sequence_number"),
      tokens: get("tokens"), tokens_exact: get("tokens_exact"), tokens_per_second: -1,
      events: [...get("events")], calls: get("calls"),
      connection: config ? "reconnecting" : "kernel lost",
      connection_detail: config ? "the kernel no longer updates this view; following from the browser" : "",
    };
    this.stopped = false;
    this.onChange();
    if (config) this.loop(config);
  }

  stop() {
    this.stopped = true;
    if (this.controller) this.controller.abort();
  }

  set(values) {
    Object.assign(this.values, values);
    this.onChange();
  }

  async loop(config) {
    const terminal = new Set(this.model.get("terminal_states"));
    const id = this.model.get("task_id");
    while (!this.stopped && !terminal.has(this.values.state)) {
      this.controller = new AbortController();
      const headers = { Accept: "text/event-stream", "Last-Event-ID": String(this.values.last_sequence_number) };
      if (config.token) headers.Authorization = `token ${config.token}`;
      try {
        const r = await fetch(`${config.baseUrl}lmsp/v1/tasks/${encodeURIComponent(id)}/events?stream=true`, {
          headers, signal: this.controller.signal, credentials: "same-origin", cache: "no-store",
        });
        if (!r.ok || !r.body) throw new Error(`HTTP ${r.status}`);
        this.failures = 0;
        this.set({ connection: "browser", connection_detail: "following from the browser (the kernel no longer updates this view)" });
        const reader = r.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true });
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            const frame = buffer.slice(0, end);
            buffer = buffer.slice(end + 2);
            const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
            if (data) this.apply(JSON.parse(data), terminal);
          }
          if (terminal.has(this.values.state)) break;
        }
      } catch (error) {
        if (this.stopped) return;
        this.failures += 1;
        this.set({
          connection: this.failures >= UNAVAILABLE_AFTER ? "server unavailable" : "reconnecting",
          connection_detail: String(error),
        });
      }
      if (this.controller) this.controller.abort();
      if (!terminal.has(this.values.state) && !this.stopped) {
        await new Promise((resolve) => setTimeout(resolve, Math.min(2000, 250 * 2 ** this.failures)));
      }
    }
    if (!this.stopped) this.set({ connection: "done", connection_detail: "" });
  }

  apply(e, terminal) {
    const v = this.values;
    if (!(e.sequence_number > v.last_sequence_number)) return;
    v.last_sequence_number = e.sequence_number;
    const next = this.model.get("event_states")[e.type];
    if (next && !terminal.has(v.state)) v.state = next;
    const response = e.response;
    if (response) {
      v.status = response.status || v.status;
      if (response.error) v.error = response.error;
      if (response.incomplete_details) v.incomplete_reason = response.incomplete_details.reason || "";
      if (terminal.has(v.state)) {
        if ((response.output || []).length) v.text = outputText(response.output);
        if (response.usage && typeof response.usage.output_tokens === "number") {
          v.tokens = response.usage.output_tokens;
          v.tokens_exact = true;
        }
      }
    }
    if (e.type === "response.queued") v.text = "";
    else if (e.type === "response.output_text.delta" && !e.choice) {
      v.text += e.delta;
      if (!v.tokens_exact) v.tokens += Math.ceil(e.delta.length / 4);
    } else if (e.type === "response.output_text.done" && !e.choice) v.text = e.text;
    v.events = [...v.events, { seq: e.sequence_number, type: e.type, detail: detailOf(e) }].slice(-MAX_EVENTS);
    this.onChange();
  }
}

function render({ model, el }) {
  const root = h("div", "lmsp-watcher");
  const head = h("div", "lmsp-head");
  const state = h("span", "lmsp-state");
  const status = h("span", "lmsp-status");
  const modelName = h("span", "lmsp-model");
  const ident = h("span", "lmsp-id");
  const conn = h("span", "lmsp-conn");
  const cancel = h("button", "lmsp-cancel", "Cancel");
  cancel.type = "button";
  head.append(state, status, modelName, ident, conn, cancel);

  const stats = h("div", "lmsp-stats");
  const elapsed = h("span", "lmsp-elapsed");
  const tokens = h("span", "lmsp-tokens");
  const rate = h("span", "lmsp-rate");
  const seq = h("span", "lmsp-seq");
  stats.append(elapsed, tokens, rate, seq);

  const text = h("pre", "lmsp-text");
  const calls = h("div", "lmsp-calls");
  const error = h("div", "lmsp-error");
  const events = h("table", "lmsp-events");
  const eventsBody = h("tbody");
  events.append(eventsBody);
  root.append(head, stats, text, calls, error, events);
  el.append(root);

  let cancelRequested = false;
  let lastElapsed = 0;
  let lastElapsedAt = performance.now();
  let lastBeat = Date.now();
  const browser = new BrowserFollower(model, () => draw());
  // A trait's value: the browser follower's while it follows, else the kernel's.
  const get = (name) => (browser.active && name in browser.values ? browser.values[name] : model.get(name));
  const isTerminal = (s) => model.get("terminal_states").includes(s);

  function drawElapsed() {
    const finished = isTerminal(get("state"));
    const started = model.get("created_at");
    if (!finished && started > 0) {
      // The task's own age, whatever the view last heard.
      elapsed.textContent = `elapsed ${fmtSeconds(Math.max(0, Date.now() / 1000 - started))}`;
      return;
    }
    const extra = finished ? 0 : (performance.now() - lastElapsedAt) / 1000;
    elapsed.textContent = `elapsed ${fmtSeconds(lastElapsed + extra)}`;
  }

  function draw() {
    const s = get("state");
    const finished = isTerminal(s);
    const shown = outcome(s, get("status"), get("incomplete_reason"), get("error"));
    root.dataset.state = s;
    root.dataset.outcome = shown.cls;
    state.textContent = shown.word;
    state.className = `lmsp-state lmsp-state-${shown.cls}`;
    status.textContent = "";
    modelName.textContent = model.get("model");
    const id = model.get("task_id");
    ident.textContent = id;
    ident.title = `task ${id}` + (model.get("response_id") ? `\nresponse ${model.get("response_id")}` : "");
    const c = get("connection");
    conn.textContent = c === "live" || c === "done" || c === "connecting" ? "" : c;
    conn.title = get("connection_detail");
    conn.className = `lmsp-conn lmsp-conn-${c.replace(/\W+/g, "-")}`;
    root.dataset.connection = c;
    cancel.disabled = finished || s === "cancelling" || cancelRequested;
    cancel.textContent = s === "cancelling" || (cancelRequested && !finished) ? "Cancelling…" : "Cancel";
    cancel.style.display = finished ? "none" : "";

    if (!browser.active) {
      lastElapsed = model.get("elapsed");
      lastElapsedAt = performance.now();
    } else if (finished) {
      const started = model.get("created_at");
      if (started > 0) lastElapsed = Math.max(lastElapsed, Date.now() / 1000 - started);
    }
    drawElapsed();
    // Nothing is shown for what is not known yet (no "seq -1", no "– tok/s").
    const n = get("tokens");
    tokens.textContent = n > 0 || finished ? `${get("tokens_exact") ? "" : "≈"}${n} tokens` : "";
    const r = get("tokens_per_second");
    rate.textContent = r >= 0 ? `${r.toFixed(1)} tok/s` : "";
    const last = get("last_sequence_number");
    seq.textContent = last >= 0 ? `seq ${last}` : "";

    const atBottom = text.scrollTop + text.clientHeight >= text.scrollHeight - 4;
    const finishedJSON = finished && model.get("format") !== "text";
    text.textContent = finishedJSON ? pretty(get("text")) : get("text");
    text.dataset.format = model.get("format");
    text.style.display = text.textContent || !get("calls").length ? "" : "none";
    calls.replaceChildren(
      ...get("calls").map((c) => {
        const call = h("div", "lmsp-call");
        call.dataset.status = c.status;
        const name = h("div", "lmsp-call-name", `${c.name}(…)` + (c.status === "completed" ? "" : ` ${c.status}`));
        const args = h("pre", "lmsp-call-args", c.status === "completed" ? pretty(c.arguments) : c.arguments);
        call.append(name, args);
        return call;
      }),
    );
    if (atBottom) text.scrollTop = text.scrollHeight;
    const err = get("error");
    error.textContent = err && err.message ? `${err.code || "error"}: ${err.message}` : "";
    error.style.display = error.textContent ? "" : "none";

    eventsBody.replaceChildren(
      ...get("events").map((e) => {
        const row = h("tr");
        row.append(h("td", "lmsp-ev-seq", String(e.seq)), h("td", "lmsp-ev-type", e.type), h("td", "lmsp-ev-detail", e.detail));
        return row;
      }),
    );
  }

  cancel.addEventListener("click", () => {
    cancelRequested = true;
    model.send({ type: "cancel" });
    draw();
  });

  const names = [
    "state", "status", "incomplete_reason", "model", "task_id", "response_id", "connection", "connection_detail", "elapsed",
    "tokens", "tokens_exact", "tokens_per_second", "last_sequence_number", "text", "calls", "format", "error", "events",
  ];
  for (const name of names) model.on(`change:${name}`, draw);
  // The kernel's heartbeat: while it comes, the kernel draws; once it stops (and the task is
  // not over) the browser follows; when the kernel has caught up again, it draws again.
  function onBeat() {
    lastBeat = Date.now();
    if (browser.active && model.get("last_sequence_number") >= browser.values.last_sequence_number) {
      browser.stop();
      draw();
    }
  }
  model.on("change:heartbeat", onBeat);
  function watch() {
    drawElapsed();
    const over = isTerminal(get("state"));
    if (!over && !browser.active && Date.now() - lastBeat > STALE_MS) browser.start();
  }
  const timer = setInterval(watch, 250);
  draw();
  return () => {
    clearInterval(timer);
    browser.stop();
    model.off("change:heartbeat", onBeat);
    for (const name of names) model.off(`change:${name}`, draw);
  };
}

export default { render };
