// The dashboard's loop: once a second, read the state and the new history samples (so the
// page is at most about a second old), the planner's recommendation, and every other second
// the request lists. Nothing is fetched before the router's API key is known when it wants
// one; a refused key stops the loop until another is typed.

import { HttpError, getJSON, keys, setKeys } from "./api.js";
import { historyPath, mergeHistory, renderCharts } from "./charts.js";
import { h } from "./dom.js";
import { onPanelNotice, renderCapacity, renderPlan, renderPlanAbsent } from "./panels.js";
import { refreshRequests, setupRequestTabs } from "./requests.js";
import { onNotice, renderRoles } from "./roles.js";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);
const needsKey = document.querySelector('meta[name="pdserve-api-key"]').content === "required";
let planAvailable = true;
let tickCount = 0;
let wake = null;
let refreshFailed = false;

let noticeTimer = null;

function notice(text, kind = "info") {
  const el = $("notice");
  el.hidden = !text;
  el.className = kind;
  el.replaceChildren(text ? document.createTextNode(text) : "");
  clearTimeout(noticeTimer);
  if (kind === "ok") noticeTimer = setTimeout(() => { el.hidden = true; }, 8000); // errors stay
}

function waitForKeys(text) {
  notice(text, "error");
  $("api-key").focus();
  return new Promise((resolve) => { wake = resolve; });
}

$("keys").addEventListener("submit", (event) => {
  event.preventDefault();
  setKeys($("api-key").value.trim(), $("admin-key").value.trim());
  $("api-key").value = "";
  $("admin-key").value = "";
  notice(keys.admin ? "keys set for this tab" : "API key set for this tab", "ok");
  if (wake) { wake(); wake = null; }
});

onNotice(notice);
onPanelNotice(notice);
setupRequestTabs($("requests-panel"), () => guarded(refreshRequests($("request-list"), $("waterfall"))));

async function guarded(work) {
  try {
    await work;
  } catch (err) {
    notice(`${err.message}`, "error");
  }
}

async function refreshPlan() {
  if (!planAvailable) return;
  try {
    renderPlan($("plan"), await getJSON("/v1/plan"));
  } catch (err) {
    if (err instanceof HttpError && err.status === 404) {
      planAvailable = false; // no planner on this router: its routes do not appear later
      renderPlanAbsent($("plan"));
      return;
    }
    throw err;
  }
}

async function tick() {
  const state = await getJSON("/v1/dashboard/state");
  renderRoles($("roles"), state);
  renderCapacity($("capacity"), state);
  $("cluster").textContent = `cluster ${state.cluster} · ${state.model} · ${state.policy}` +
    (state.scaler ? ` · scaler ${state.scaler}` : " · no scaler") + (state.stale ? " · STALE (Redis unreadable)" : "");
  if (state.scaler_error) notice(state.scaler_error, "error");
  mergeHistory(await getJSON(historyPath()));
  renderCharts($("charts"));
  await guarded(refreshPlan());
  if (tickCount % 2 === 0) await guarded(refreshRequests($("request-list"), $("waterfall")));
  tickCount += 1;
  $("updated").textContent = `updated ${new Date(state.now_unix * 1000).toLocaleTimeString()}`;
}

async function loop() {
  if (needsKey && !keys.api) await waitForKeys("This router needs its API key: type it above.");
  for (;;) {
    const started = performance.now();
    try {
      await tick();
      $("updated").classList.remove("late");
      if (refreshFailed) notice("");
      refreshFailed = false;
    } catch (err) {
      if (err instanceof HttpError && err.status === 401) {
        await waitForKeys("The router refused the API key: type it again above.");
        continue;
      }
      $("updated").classList.add("late");
      refreshFailed = true;
      notice(`cannot refresh: ${err.message}`, "error");
    }
    await new Promise((resolve) => setTimeout(resolve, Math.max(POLL_MS - (performance.now() - started), 50)));
  }
}

document.body.append(h("footer", { class: "muted" }, "pdserve ops dashboard · charts by uPlot (MIT)"));
loop();
