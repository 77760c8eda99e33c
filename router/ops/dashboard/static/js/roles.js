// One card per scalable role: desired / ready / draining, what is still pending, the scale
// controls (set, -, +) and a row per worker with its KV bar and a drain button. Cards and rows
// are kept across refreshes (keyed by role and worker id), so a half-typed replica count, a
// focused button or an armed drain survive the once-a-second update.

import { drainWorker, scaleRole } from "./api.js";
import { h, num } from "./dom.js";

const cards = new Map();
const ARM_MS = 5000; // a drain needs a second click within this time
let notify = () => {};

export function onNotice(callback) { notify = callback; }

export function renderRoles(container, state) {
  for (const role of state.roles) {
    let card = cards.get(role.role);
    if (!card) {
      card = makeCard(role.role);
      cards.set(role.role, card);
      container.append(card.root);
    }
    updateCard(card, role, state.scaler);
  }
}

function makeCard(role) {
  const button = (cls, title, text) => h("button", { type: "button", class: cls, title, dataset: { role } }, text);
  const card = {
    role, rows: new Map(), desired: null, ready: 0, busy: false,
    desiredEl: h("b", { class: "desired" }), readyEl: h("b", { class: "ready" }), drainingEl: h("b", { class: "draining" }),
    pending: h("span", { class: "pending", hidden: true }),
    restarts: h("span", { class: "muted restarts" }),
    input: h("input", { type: "number", min: 0, step: 1, class: "replicas", "aria-label": `${role} replicas` }),
    minus: button("scale-minus", `one ${role} worker fewer`, "−"),
    plus: button("scale-plus", `one more ${role} worker`, "+"),
    set: button("scale-set", `set the ${role} replicas`, "Set"),
    tbody: h("tbody"),
  };
  card.input.addEventListener("input", () => { card.input.dataset.dirty = "1"; });
  card.input.addEventListener("keydown", (e) => { if (e.key === "Enter") scaleTo(card, card.input.value); });
  card.minus.addEventListener("click", () => scaleTo(card, base(card) - 1));
  card.plus.addEventListener("click", () => scaleTo(card, base(card) + 1));
  card.set.addEventListener("click", () => scaleTo(card, card.input.value));
  const key = (part) => [h("span", { class: `swatch ${part}` }), part];
  const kvHeader = ["KV blocks: ", key("used"), " / ", key("reserved"), " / ", key("cached"), " / ", key("free")];
  const headers = ["worker", "state", kvHeader, "running", "waiting", "heartbeat", ""];
  card.root = h("section", { class: "panel role", id: `role-${role}`, dataset: { role } },
    h("h2", {}, role, " ", card.pending),
    h("p", { class: "counts" }, "desired ", card.desiredEl, " · ready ", card.readyEl,
      " · draining ", card.drainingEl, " ", card.restarts),
    h("div", { class: "controls" }, card.minus, card.input, card.plus, card.set),
    h("table", { class: "workers" }, h("thead", {}, h("tr", {}, headers.map((t) => h("th", {}, t)))), card.tbody));
  return card;
}

function base(card) { return card.desired ?? card.ready; }

async function scaleTo(card, value) {
  const replicas = Number(value);
  if (!Number.isInteger(replicas) || replicas < 0) {
    notify(`${card.role}: replicas must be a whole number >= 0`, "error");
    return;
  }
  if (card.busy) return;
  card.busy = true;
  try {
    const status = await scaleRole(card.role, replicas);
    card.desired = status.desired;
    card.desiredEl.textContent = num(status.desired);
    card.pending.hidden = false; // until the next state says what is left to do
    card.pending.textContent = `pending: ${status.desired} requested`;
    delete card.input.dataset.dirty;
    notify(`${card.role}: desired ${status.desired} (ready ${status.ready})`, "ok");
  } catch (err) {
    notify(`${card.role}: ${err.message}${err.status === 401 ? " (scaling needs the admin key)" : ""}`, "error");
  } finally {
    card.busy = false;
  }
}

function updateCard(card, role, scaler) {
  card.desired = role.desired;
  card.ready = role.ready;
  card.desiredEl.textContent = role.desired === null ? "–" : num(role.desired);
  card.readyEl.textContent = num(role.ready);
  card.drainingEl.textContent = num(role.draining);
  card.restarts.textContent = role.restarts ? `${role.restarts} restarts` : "";
  card.pending.hidden = !role.pending;
  card.pending.textContent = role.pending ? `pending: ${role.pending}` : "";
  if (!card.input.dataset.dirty && document.activeElement !== card.input) {
    card.input.value = role.desired ?? role.ready;
  }
  for (const control of [card.minus, card.plus, card.set, card.input]) {
    control.disabled = scaler === null;
    if (scaler === null) control.title = "this router has no scaler (--scaler none)";
  }
  const seen = new Set();
  for (const worker of role.workers) {
    seen.add(worker.worker_id);
    let row = card.rows.get(worker.worker_id);
    if (!row) {
      row = makeRow(worker.worker_id);
      card.rows.set(worker.worker_id, row);
    }
    updateRow(row, worker);
    card.tbody.append(row.tr); // keeps the rows in the state's (id) order
  }
  for (const [id, row] of card.rows) {
    if (!seen.has(id)) { row.tr.remove(); card.rows.delete(id); }
  }
}

function makeRow(workerId) {
  const seg = (cls) => h("span", { class: `seg ${cls}` });
  const row = {
    id: h("td", { class: "worker-id" }, workerId),
    state: h("span", { class: "state" }),
    segs: { used: seg("used"), reserved: seg("reserved"), cached: seg("cached"), free: seg("free") },
    barLabel: h("span", { class: "bar-label" }),
    running: h("td", { class: "num running" }), waiting: h("td", { class: "num waiting" }),
    age: h("td", { class: "num age" }),
    drain: h("button", { type: "button", class: "drain", title: "finish its requests, then exit" }, "Drain"),
    armedUntil: 0,
  };
  row.bar = h("div", { class: "kvbar" }, Object.values(row.segs));
  row.tr = h("tr", { class: "worker", dataset: { workerId } }, row.id, h("td", {}, row.state),
    h("td", { class: "kv" }, row.bar, row.barLabel), row.running, row.waiting, row.age, h("td", {}, row.drain));
  row.drain.addEventListener("click", () => drainClicked(row, workerId));
  return row;
}

function updateRow(row, w) {
  const bar = w.kv_bar;
  const total = w.total_blocks || 1;
  for (const [part, el] of Object.entries(row.segs)) el.style.width = `${(100 * bar[part]) / total}%`;
  row.bar.title = `used ${bar.used}, reserved ${bar.reserved}, cached ${bar.cached}, free ${bar.free} of ` +
    `${w.total_blocks} blocks x ${w.block_size} tokens`;
  row.barLabel.textContent = `${bar.used} / ${bar.reserved} / ${bar.cached} / ${bar.free} of ${w.total_blocks}`;
  row.state.textContent = w.state;
  row.state.className = `state ${w.state}`;
  row.id.title = `${w.address} · incarnation ${w.incarnation}`;
  row.tr.dataset.incarnation = w.incarnation;
  row.running.textContent = num(w.num_running);
  row.waiting.textContent = num(w.num_waiting);
  row.age.textContent = `${num(w.heartbeat_age_s, 1)} s`;
  row.drain.disabled = w.state === "draining";
  if (row.armedUntil && Date.now() > row.armedUntil) disarm(row);
}

function disarm(row) {
  row.armedUntil = 0;
  row.drain.textContent = "Drain";
  row.drain.classList.remove("armed");
}

async function drainClicked(row, workerId) {
  if (!row.armedUntil || Date.now() > row.armedUntil) {
    row.armedUntil = Date.now() + ARM_MS;
    row.drain.textContent = "Confirm drain";
    row.drain.classList.add("armed");
    return;
  }
  disarm(row);
  row.drain.disabled = true;
  try {
    const outcome = await drainWorker(workerId);
    notify(`${workerId}: draining (${outcome.in_flight} requests in flight)`, "ok");
  } catch (err) {
    row.drain.disabled = false;
    notify(`${workerId}: ${err.message}${err.status === 401 ? " (draining needs the admin key)" : ""}`, "error");
  }
}
