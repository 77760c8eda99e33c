// Capacity (the FastDeploy FAQ's arithmetic, live), the admission queue, rejections,
// fallbacks and transfers; and the planner's recommendation with its arithmetic and an Apply
// button. Both are rebuilt only when their data changed, so a click is never lost to a refresh.

import { scaleRole } from "./api.js";
import { bytes, fill, h, num, table } from "./dom.js";

let lastCapacity = "";
let lastPlan = "";
let notify = () => {};

export function onPanelNotice(callback) { notify = callback; }

export function renderCapacity(container, state) {
  const key = JSON.stringify([state.roles.map((r) => r.capacity), state.admission, state.fallbacks,
    state.transfers, state.mean_length]);
  if (key === lastCapacity) return;
  lastCapacity = key;
  const rows = state.roles.map((r) => h("tr", { dataset: { role: r.role } },
    h("td", {}, r.role),
    h("td", { class: "formula" }, r.capacity.formula),
    h("td", { class: "num" }, num(r.capacity.free_tokens)),
    h("td", { class: "num concurrency" }, num(r.capacity.concurrency)),
    h("td", { class: "num" }, num(r.capacity.free_concurrency))));
  const q = state.admission;
  const reasons = Object.entries(q.rejections);
  const fallbacks = Object.entries(state.fallbacks);
  fill(container,
    table(["role", "blocks x block size = tokens; / mean request = concurrency", "free tokens", "concurrency", "free now"],
      rows, { class: "capacity" }),
    h("p", { class: "muted basis" }, `Mean request: ${num(state.mean_length.tokens, 1)} tokens (${state.mean_length.basis}).`),
    h("p", { class: "admission" }, "Admission queue: ", h("b", { class: "waiting" }, num(q.waiting)),
      ` waiting of at most ${num(q.max_queued)} (${num(q.blocks_waiting)} blocks; up to ${num(q.max_wait_s, 1)} s each)`),
    h("p", {}, "Rejections: ", reasons.length
      ? reasons.map(([reason, n], i) => [i ? ", " : "", h("span", { class: "rejection", dataset: { reason } }, `${reason} ${n}`)])
      : h("span", { class: "muted" }, "none")),
    h("p", {}, "Path fallbacks: ", fallbacks.length
      ? fallbacks.map(([reason, n]) => `${reason} ${n}`).join(", ") : h("span", { class: "muted" }, "none")),
    state.transfers.links.length ? table(["link", "transfers", "bytes", "GB/s (mean)"],
      state.transfers.links.map((l) => h("tr", {}, h("td", {}, `${l.prefill_id} → ${l.decode_id}`),
        h("td", { class: "num" }, num(l.count)), h("td", { class: "num" }, bytes(l.nbytes)),
        h("td", { class: "num" }, num(l.gbps, 3)))), { class: "links" }) : null);
}

export function renderPlanAbsent(container) {
  if (lastPlan === "absent") return;
  lastPlan = "absent";
  fill(container, h("p", { class: "muted", id: "plan-absent" }, "planner not enabled on this router"));
}

export function renderPlan(container, plan) {
  const key = JSON.stringify(plan);
  if (key === lastPlan) return;
  lastPlan = key;
  const roles = Object.keys(plan.recommended);
  const changes = roles.filter((r) => plan.recommended[r] !== plan.current[r]);
  const apply = h("button", { type: "button", id: "plan-apply", disabled: changes.length === 0 },
    changes.length ? `Apply (${changes.map((r) => `${r} ${plan.current[r]} → ${plan.recommended[r]}`).join(", ")})` : "Nothing to apply");
  apply.addEventListener("click", () => applyPlan(apply, plan, changes));
  const auto = plan.autoscale;
  const last = auto.last_action;
  fill(container,
    table(["role", "now", "recommended", "why"], roles.map((r) => h("tr", { dataset: { role: r } },
      h("td", {}, r), h("td", { class: "num" }, num(plan.current[r])),
      h("td", { class: "num recommended" }, num(plan.recommended[r])), h("td", {}, plan.reasons[r] || "")))),
    h("pre", { class: "arithmetic" }, plan.arithmetic.join("\n")),
    h("p", { class: "muted" }, `SLO: TTFT ${plan.slo.ttft_ms ?? "–"} ms, ITL ${plan.slo.itl_ms ?? "–"} ms; ` +
      `window ${num(plan.window_s)} s; autoscale ${auto.enabled ? "on" : "off"}` +
      (last ? `; last: ${last.role} ${last.from} → ${last.to} (${last.why})` : "")),
    apply);
}

async function applyPlan(button, plan, changes) {
  button.disabled = true;
  for (const role of changes) {
    try {
      await scaleRole(role, plan.recommended[role]);
      notify(`${role}: desired ${plan.recommended[role]} (planner)`, "ok");
    } catch (err) {
      notify(`${role}: ${err.message}${err.status === 401 ? " (scaling needs the admin key)" : ""}`, "error");
    }
  }
  lastPlan = ""; // redraw with the next plan
}
