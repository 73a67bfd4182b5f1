// TaskBoard table view (anywidget ES module; no imports, no CDN). The kernel polls the
// service's task list and sets `rows`; this view draws them, lets the user pick a state filter
// (synced back as `state_filter`) and sends {type: "open", task_id} when a row is clicked.

const FILTERS = [
  ["", "all"],
  ["queued,loading,running,cancelling", "unfinished"],
  ["queued", "queued"],
  ["loading", "loading"],
  ["running", "running"],
  ["cancelling", "cancelling"],
  ["completed", "completed"],
  ["failed", "failed"],
  ["cancelled", "cancelled"],
];

function h(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function ago(t) {
  if (!t) return "";
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 60) return `${s.toFixed(0)} s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)} min ago`;
  if (s < 86400) return `${(s / 3600).toFixed(0)} h ago`;
  return new Date(t * 1000).toLocaleString();
}

function render({ model, el }) {
  const root = h("div", "lmsp-board");
  const bar = h("div", "lmsp-board-bar");
  const title = h("strong", "", "Tasks");
  const label = h("label", "", "state ");
  const select = h("select", "lmsp-board-filter");
  for (const [value, name] of FILTERS) {
    const opt = h("option", "", name);
    opt.value = value;
    select.append(opt);
  }
  label.append(select);
  const count = h("span", "lmsp-board-count");
  const conn = h("span", "lmsp-conn");
  // Pages of `page_size` rows: the list may hold every task of the database.
  const prev = h("button", "lmsp-board-prev", "‹");
  const next = h("button", "lmsp-board-next", "›");
  prev.type = next.type = "button";
  const pageInfo = h("span", "lmsp-board-page");
  const pager = h("span", "lmsp-board-pager");
  pager.append(prev, pageInfo, next);
  bar.append(title, label, count, pager, conn);
  let page = 0;
  prev.addEventListener("click", () => { page -= 1; draw(); });
  next.addEventListener("click", () => { page += 1; draw(); });

  const table = h("table", "lmsp-board-table");
  const thead = h("thead");
  const headRow = h("tr");
  for (const name of ["task", "kind", "state", "model", "created", "events", "restart", ""]) {
    headRow.append(h("th", "", name));
  }
  thead.append(headRow);
  const body = h("tbody");
  table.append(thead, body);
  root.append(bar, table);
  el.append(root);

  select.addEventListener("change", () => {
    page = 0;
    model.set("state_filter", select.value);
    model.save_changes();
  });

  function open(id) {
    model.send({ type: "open", task_id: id });
  }

  function draw() {
    select.value = model.get("state_filter");
    const all = model.get("rows");
    const size = Math.max(1, model.get("page_size"));
    const pages = Math.max(1, Math.ceil(all.length / size));
    page = Math.min(Math.max(0, page), pages - 1);
    const rows = all.slice(page * size, (page + 1) * size);
    count.textContent = `${all.length} tasks`;
    pager.style.display = pages > 1 ? "" : "none";
    pageInfo.textContent = `${page * size + 1}–${page * size + rows.length} of ${all.length}`;
    prev.disabled = page === 0;
    next.disabled = page >= pages - 1;
    const c = model.get("connection");
    conn.textContent = c === "live" ? "" : c;
    const selected = model.get("selected");
    body.replaceChildren(
      ...rows.map((r) => {
        const tr = h("tr", "lmsp-row");
        tr.dataset.taskId = r.id;
        if (r.id === selected) tr.style.fontWeight = "600";
        const state = h("span", `lmsp-state lmsp-state-${r.state}`, r.state);
        const stateCell = h("td");
        stateCell.append(state);
        if (r.error_code) stateCell.append(" ", h("span", "lmsp-error", r.error_code));
        const button = h("button", "lmsp-open", "Open");
        button.type = "button";
        button.addEventListener("click", (ev) => {
          ev.stopPropagation();
          open(r.id);
        });
        const buttonCell = h("td");
        buttonCell.append(button);
        tr.append(
          h("td", "lmsp-id", r.id),
          h("td", "", r.kind),
          stateCell,
          h("td", "lmsp-model", r.model || ""),
          h("td", "", ago(r.created_at)),
          h("td", "lmsp-ev-seq", String(r.last_sequence_number + 1)),
          h("td", "", r.on_restart || ""),
          buttonCell,
        );
        tr.addEventListener("click", () => open(r.id));
        return tr;
      }),
    );
  }

  const names = ["rows", "state_filter", "connection", "selected", "page_size"];
  for (const name of names) model.on(`change:${name}`, draw);
  draw();
  return () => {
    for (const name of names) model.off(`change:${name}`, draw);
  };
}

export default { render };
