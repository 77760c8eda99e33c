// The 15-minute charts (uPlot, vendored). The page keeps its own copy of the router's
// history and asks only for the samples after the newest one it has, so each poll moves a
// few numbers, not 900 rows. A series that appears later (a new link, a new role) is padded
// with nulls before it, and a chart is rebuilt when its set of series changes.

import { h } from "./dom.js";

const CAPACITY = 900;
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#be185d", "#4b5563"];
const CHARTS = [
  { id: "request-rate", title: "Requests finished / s", names: ["request_rate"], labels: ["requests/s"] },
  { id: "ttft", title: "Time to first token (ms)", names: ["ttft_p50_ms", "ttft_p99_ms"], labels: ["p50", "p99"] },
  { id: "itl", title: "Inter-token latency (ms)", names: ["itl_p50_ms", "itl_p99_ms"], labels: ["p50", "p99"] },
  { id: "e2e", title: "End-to-end latency (ms)", names: ["e2e_p50_ms", "e2e_p99_ms"], labels: ["p50", "p99"] },
  { id: "tokens", title: "Tokens / s", names: ["prompt_tokens_per_s", "generation_tokens_per_s"], labels: ["prompt", "generation"] },
  { id: "kv", title: "KV usage per role (%)", prefix: "kv_usage." },
  { id: "transfer", title: "KV transfer GB/s per link", prefix: "transfer_gbps." },
  { id: "fallbacks", title: "Path fallbacks / min", prefix: "fallbacks." },
];

const history = { t: [], series: {} };
let newest = null;
const charts = new Map();

export function historyPath() {
  return newest === null ? "/v1/dashboard/history" : `/v1/dashboard/history?since=${newest}`;
}

export function mergeHistory(part) {
  const before = history.t.length;
  for (const name of Object.keys(part.series)) {
    if (!(name in history.series)) history.series[name] = new Array(before).fill(null);
  }
  history.t.push(...part.t);
  for (const [name, values] of Object.entries(history.series)) {
    values.push(...(part.series[name] || new Array(part.t.length).fill(null)));
  }
  const extra = history.t.length - CAPACITY;
  if (extra > 0) {
    history.t.splice(0, extra);
    for (const values of Object.values(history.series)) values.splice(0, extra);
  }
  if (part.t.length) newest = part.t[part.t.length - 1];
}

function seriesOf(spec) {
  if (spec.names) return spec.names.map((name, i) => ({ name, label: spec.labels[i] }));
  return Object.keys(history.series).filter((n) => n.startsWith(spec.prefix)).sort()
    .map((name) => ({ name, label: name.slice(spec.prefix.length) }));
}

export function renderCharts(container) {
  if (typeof window.uPlot !== "function") return;
  for (const spec of CHARTS) {
    const series = seriesOf(spec);
    const key = series.map((s) => s.name).join("|");
    let chart = charts.get(spec.id);
    if (!chart) {
      chart = { plotEl: h("div", { class: "plot" }), empty: h("p", { class: "muted empty" }, "nothing yet") };
      chart.root = h("div", { class: "chart", id: `chart-${spec.id}`, dataset: { points: "0" } },
        h("h3", {}, spec.title), chart.plotEl, chart.empty);
      container.append(chart.root);
      charts.set(spec.id, chart);
    }
    const data = [history.t, ...series.map((s) => history.series[s.name])];
    if (chart.key !== key) {
      if (chart.plot) {
        chart.observer.disconnect();
        chart.plot.destroy();
      }
      chart.plot = series.length ? makePlot(chart, series, data) : null;
      chart.key = key;
    } else if (chart.plot) {
      chart.plot.setData(data);
    }
    const points = series.reduce((n, s) => n + history.series[s.name].filter((v) => v !== null).length, 0);
    chart.root.dataset.points = String(points);
    chart.empty.hidden = points > 0;
  }
}

function makePlot(chart, series, data) {
  const el = chart.plotEl;
  const width = Math.max(el.clientWidth || el.parentElement.clientWidth - 16, 240);
  const opts = {
    width, height: 150,
    scales: { x: { time: true } },
    series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5 }))],
    axes: [{ size: 30 }, { size: 56 }],
    legend: { live: false },
  };
  const plot = new window.uPlot(opts, data, el);
  chart.observer = new ResizeObserver(() => {
    const w = Math.max(el.clientWidth, 240);
    if (Math.abs(w - plot.width) > 4) plot.setSize({ width: w, height: 150 });
  });
  chart.observer.observe(el);
  return plot;
}
