// Recent and slowest requests (GET /v1/requests) and, for the one clicked, its P/D timeline
// as a waterfall: each phase a bar on a millisecond axis from arrival to the last byte, the
// first and last token as marks, and the routing and transfer details beside it.

import { HttpError, getJSON } from "./api.js";
import { bytes, fill, h, ms, num, table } from "./dom.js";

let order = "recent";
let lastList = "";
let available = true;
let selected = null;

export function setupRequestTabs(root, onChange) {
  for (const tab of root.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => {
      order = tab.dataset.order;
      for (const other of root.querySelectorAll(".tab")) other.classList.toggle("active", other === tab);
      lastList = "";
      onChange();
    });
  }
}

export async function refreshRequests(listEl, waterfallEl) {
  if (!available) return;
  let list;
  try {
    list = await getJSON(`/v1/requests?order=${order}&limit=20`);
  } catch (err) {
    if (err instanceof HttpError && err.status === 404) {
      available = false; // the router has no timelines: ask once per page, not every second
      fill(listEl, h("p", { class: "muted", id: "timelines-absent" }, "request timelines not enabled on this router"));
      return;
    }
    throw err;
  }
  const key = order + JSON.stringify(list.data.map((t) => [t.request_id, t.e2e_ms]));
  if (key === lastList) return;
  lastList = key;
  const rows = list.data.map((t) => {
    const tr = h("tr", { class: "request", dataset: { requestId: t.request_id }, tabIndex: 0 },
      h("td", { class: "rid" }, t.request_id.slice(0, 12)),
      h("td", { class: "num" }, ms(t.e2e_ms)), h("td", { class: "num" }, ms(t.ttft_ms)),
      h("td", {}, t.path || "–"), h("td", {}, t.finish_reason || "–"),
      h("td", {}, t.route ? `${t.route.prefill_id ?? "(local)"} → ${t.route.decode_id}` : "–"));
    tr.title = t.request_id;
    tr.classList.toggle("selected", t.request_id === selected);
    const open = () => showTimeline(t.request_id, waterfallEl, listEl);
    tr.addEventListener("click", open);
    tr.addEventListener("keydown", (e) => { if (e.key === "Enter") open(); });
    return tr;
  });
  fill(listEl, rows.length
    ? table(["request", "e2e", "TTFT", "path", "finish", "P → D"], rows, { class: "requests" })
    : h("p", { class: "muted" }, "no requests yet"));
}

async function showTimeline(requestId, waterfallEl, listEl) {
  selected = requestId;
  for (const tr of listEl.querySelectorAll("tr.request")) tr.classList.toggle("selected", tr.dataset.requestId === requestId);
  try {
    renderWaterfall(waterfallEl, await getJSON(`/v1/requests/${encodeURIComponent(requestId)}/timeline`));
  } catch (err) {
    fill(waterfallEl, h("p", { class: "error" }, `${requestId}: ${err.message}`));
  }
}

export function renderWaterfall(el, t) {
  const span = Math.max(t.e2e_ms, 1e-3);
  const pct = (value) => `${Math.min(Math.max((100 * value) / span, 0), 100)}%`;
  // A mark past 70% of the axis carries its label on its left, so it stays inside the panel.
  const marks = t.marks.map((m) => h("div", { class: m.at_ms > 0.7 * span ? "mark end" : "mark",
    title: `${m.name} at ${ms(m.at_ms)}`, style: { left: pct(m.at_ms) } }, h("span", {}, m.name.replace("_", " "))));
  const rows = t.phases.map((p) => h("div", { class: "phase", dataset: { phase: p.name } },
    h("div", { class: "phase-name" }, p.name),
    h("div", { class: "track" },
      h("div", { class: "bar", title: `${p.name}: ${ms(p.start_ms)} → ${ms(p.end_ms)}`,
        style: { left: pct(p.start_ms), width: pct(p.duration_ms) } })),
    h("div", { class: "phase-ms num" }, ms(p.duration_ms)),
    Object.keys(p.detail).length
      ? h("div", { class: "phase-detail muted" }, Object.entries(p.detail).map(([k, v]) => `${k} ${typeof v === "number" ? num(v, 4) : v}`).join(" · "))
      : null));
  const ticks = [0, 0.25, 0.5, 0.75, 1].map((f) => h("span", { class: f === 0 ? "first" : f === 1 ? "last" : "",
    style: { left: `${f * 100}%` } }, ms(f * t.e2e_ms)));
  fill(el,
    h("h3", {}, `Request ${t.request_id}`),
    h("p", { class: "summary" }, `${t.path || "–"} · ${t.finish_reason || "–"} · e2e ${ms(t.e2e_ms)} · TTFT ${ms(t.ttft_ms)} · ` +
      `${num(t.prompt_tokens)} prompt + ${num(t.completion_tokens)} output tokens` + (t.sequences > 1 ? ` · ${t.sequences} sequences` : "")),
    h("div", { class: "waterfall" }, h("div", { class: "axis" }, ticks), h("div", { class: "marks" }, marks), rows),
    t.route ? h("p", { class: "route" }, `Route: ${t.route.prefill_id ?? "(decode worker prefilled)"} → ${t.route.decode_id} — ${t.route.reason}` +
      (t.route.fallback ? ` (fallback: ${t.route.fallback})` : "") +
      (Object.keys(t.route.inputs).length ? ` [${Object.entries(t.route.inputs).map(([k, v]) => `${k} ${num(v, 3)}`).join(", ")}]` : "")) : null,
    t.transfer ? h("p", { class: "transfer" }, `KV transfer: ${bytes(t.transfer.nbytes)} ` + (t.transfer.wire_seconds == null
      ? `in ${ms(t.transfer.seconds * 1000)} (${num(t.transfer.gbps, 3)} GB/s)`
      : `in ${ms(t.transfer.wire_seconds * 1000)} on the wire (${num(t.transfer.wire_gbps, 3)} GB/s) of ` +
        `${ms(t.transfer.seconds * 1000)} open (streamed during the prefill)`) +
      ` over ${t.transfer.backend}; ${num(t.transfer.num_blocks)} blocks sent, ` +
      `${num(t.transfer.blocks_skipped)} skipped (decode prefix cache)`) : null,
    t.error ? h("p", { class: "error" }, `Error: ${t.error}`) : null);
}
