// TaskWatcher view (anywidget ES module; no imports, no build step, nothing from a CDN).
// The kernel side follows the task's event log and sets the synced traits; this view only
// draws them, ticks the elapsed time locally between updates, and sends {type: "cancel"}.

const TERMINAL = new Set(["completed", "failed", "cancelled"]);

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

  function drawElapsed() {
    const finished = TERMINAL.has(model.get("state"));
    const extra = finished ? 0 : (performance.now() - lastElapsedAt) / 1000;
    elapsed.textContent = `elapsed ${fmtSeconds(lastElapsed + extra)}`;
  }

  function draw() {
    const s = model.get("state");
    const finished = TERMINAL.has(s);
    root.dataset.state = s;
    state.textContent = s;
    state.className = `lmsp-state lmsp-state-${s}`;
    // The response's own status when it says more than the task state (e.g. `incomplete`).
    const st = model.get("status");
    const reason = model.get("incomplete_reason");
    status.textContent = finished && st && st !== s ? (reason ? `${st}: ${reason}` : st) : "";
    modelName.textContent = model.get("model");
    const id = model.get("task_id");
    ident.textContent = id;
    ident.title = `task ${id}` + (model.get("response_id") ? `\nresponse ${model.get("response_id")}` : "");
    const c = model.get("connection");
    conn.textContent = c === "live" || c === "done" ? "" : c;
    conn.title = model.get("connection_detail");
    conn.className = `lmsp-conn lmsp-conn-${c}`;
    cancel.disabled = finished || s === "cancelling" || cancelRequested;
    cancel.textContent = s === "cancelling" || (cancelRequested && !finished) ? "Cancelling…" : "Cancel";
    cancel.style.display = finished ? "none" : "";

    lastElapsed = model.get("elapsed");
    lastElapsedAt = performance.now();
    drawElapsed();
    const n = model.get("tokens");
    tokens.textContent = `${model.get("tokens_exact") ? "" : "≈"}${n} tokens`;
    const r = model.get("tokens_per_second");
    rate.textContent = r >= 0 ? `${r.toFixed(1)} tok/s` : "– tok/s";
    seq.textContent = `seq ${model.get("last_sequence_number")}`;

    const atBottom = text.scrollTop + text.clientHeight >= text.scrollHeight - 4;
    const finishedJSON = finished && model.get("format") !== "text";
    text.textContent = finishedJSON ? pretty(model.get("text")) : model.get("text");
    text.dataset.format = model.get("format");
    text.style.display = text.textContent || !model.get("calls").length ? "" : "none";
    calls.replaceChildren(
      ...model.get("calls").map((c) => {
        const call = h("div", "lmsp-call");
        call.dataset.status = c.status;
        const name = h("div", "lmsp-call-name", `${c.name}(…)` + (c.status === "completed" ? "" : ` ${c.status}`));
        const args = h("pre", "lmsp-call-args", c.status === "completed" ? pretty(c.arguments) : c.arguments);
        call.append(name, args);
        return call;
      }),
    );
    if (atBottom) text.scrollTop = text.scrollHeight;
    const err = model.get("error");
    error.textContent = err && err.message ? `${err.code || "error"}: ${err.message}` : "";
    error.style.display = error.textContent ? "" : "none";

    eventsBody.replaceChildren(
      ...model.get("events").map((e) => {
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
  const timer = setInterval(drawElapsed, 250);
  draw();
  return () => {
    clearInterval(timer);
    for (const name of names) model.off(`change:${name}`, draw);
  };
}

export default { render };
