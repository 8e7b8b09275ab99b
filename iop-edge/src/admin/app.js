// The Edge's status page (the helpers el, pill, ago, row, fill, live are common.js's).
"use strict";

let selectedNode = null;
let selectedProvider = null;
let last = null;
let previous = null; // { at: ms, t: traffic } for rates

function ms(n) {
  if (n === null || n === undefined) return "–";
  if (n < 1000) return n + " ms";
  return (n / 1000).toFixed(1) + " s";
}

function pairs(dl, entries) {
  dl.replaceChildren();
  for (const [k, val] of entries) {
    dl.appendChild(el("dt", k));
    dl.appendChild(val instanceof Node ? wrap("dd", val) : el("dd", val === null || val === undefined || val === "" ? "–" : val));
  }
}

function wrap(tag, child) {
  const e = el(tag);
  e.appendChild(child);
  return e;
}

function renderNodes(v) {
  const rows = v.nodes.map((n) => {
    const tr = row([n.id, pill(n.state), n.generation, n.version, ago(n.since_ms), ago(n.last_heard_ms),
      n.runs, n.tunnels, n.reason],
      "clickable state-" + n.state + (n.id === selectedNode ? " selected" : ""));
    tr.dataset.node = n.id;
    tr.tabIndex = 0;
    tr.addEventListener("click", () => selectNode(n.id));
    tr.addEventListener("keydown", (e) => { if (e.key === "Enter") selectNode(n.id); });
    return tr;
  });
  fill(document.querySelector("#nodes tbody"), rows, "no Node has connected yet", 9);
  document.getElementById("nodes-ready").textContent =
    v.nodes.filter((n) => n.state === "ready" || n.state === "warned").length + " / " + v.nodes.length;
}

function renderActions(v) {
  const actions = document.getElementById("node-actions");
  const node = v.nodes.find((n) => n.id === selectedNode);
  const ready = node && (node.state === "ready" || node.state === "warned");
  actions.hidden = !ready;
  if (ready) document.getElementById("probe").textContent = "Probe " + node.id + "'s providers now";
}

// The page's one action: asks the operator, then sends the confirmation header the server
// requires (a page of another origin cannot send it).
async function probe() {
  const node = selectedNode;
  if (node === null) return;
  if (!window.confirm("Ask " + node + " to probe its providers now? An overlay clears only if a provider answers available.")) return;
  const result = document.getElementById("probe-result");
  result.textContent = "probing…";
  try {
    const r = await fetch("api/nodes/" + encodeURIComponent(node) + "/probe",
      { method: "POST", headers: { "x-iop-confirm": "confirmed" } });
    const body = await r.json();
    result.textContent = r.ok ? "probed " + node + ": " + body.cleared + " overlay(s) cleared" : "not probed: " + body.error;
  } catch (e) {
    result.textContent = "not probed: " + e;
  }
}

function renderProviders(v) {
  const shown = v.providers.filter((p) => selectedNode === null || p.node_id === selectedNode);
  const rows = shown.map((p) => {
    const key = p.node_id + "/" + p.id;
    const tr = row([p.id, p.node_id, p.models.join(", "), p.target, pill(p.health),
      p.cause ? p.cause + (p.unavailable_since_ms ? " — since " + ago(p.unavailable_since_ms) : "") : "",
      p.capacity, p.in_flight, p.queued, p.long_capacity + " / " + p.long_in_flight + " / " + p.long_queued],
      "clickable state-" + (p.health === "healthy" ? "ready" : "down") + (key === selectedProvider ? " selected" : ""));
    tr.dataset.provider = p.id;
    tr.dataset.node = p.node_id;
    tr.tabIndex = 0;
    tr.addEventListener("click", () => selectProvider(key));
    tr.addEventListener("keydown", (e) => { if (e.key === "Enter") selectProvider(key); });
    return tr;
  });
  fill(document.querySelector("#providers tbody"), rows, "no provider", 10);
  document.getElementById("provider-filter").textContent =
    selectedNode === null ? "(all Nodes)" : "(Node " + selectedNode + ")";

  const detail = document.getElementById("provider-detail");
  const p = v.providers.find((x) => x.node_id + "/" + x.id === selectedProvider);
  detail.hidden = !p;
  if (!p) return;
  document.getElementById("provider-detail-title").textContent = "Provider " + p.id + " on " + p.node_id;
  const probe = p.last_probe
    ? p.last_probe.status + (p.last_probe.cleared ? ", cleared the overlay" : p.last_probe.fresh ? "" : " (stale)") +
      " — " + ago(p.last_probe.at_ms)
    : "none yet";
  pairs(document.getElementById("provider-detail-pairs"), [
    ["Models", p.models.join(", ")],
    ["Adapter", p.adapter],
    ["Target", p.target],
    ["Status", p.status],
    ["Health", pill(p.health)],
    ["Why", p.cause],
    ["Unavailable since", p.unavailable_since_ms ? ago(p.unavailable_since_ms) : ""],
    ["Last recovery probe", probe],
    ["Capacity / in flight / queued", p.capacity + " / " + p.in_flight + " / " + p.queued],
    ["Long context (cap / in flight / queued)", p.long_capacity + " / " + p.long_in_flight + " / " + p.long_queued],
    ["Enabled", p.enabled ? "yes" : "no"],
  ]);
}

function usedOf(pair) {
  return pair ? pair[0] + " / " + pair[1] : "–";
}

function usd(x) {
  return "$" + (x > 0 && x < 0.01 ? x.toPrecision(2) : x.toFixed(2));
}

function dollars(pair) {
  return pair ? usd(pair[0]) + " / " + usd(pair[1]) : "–";
}

function bar(share) {
  const outer = el("span", null, "bar" + (share >= 0.9 ? " bar-bad" : share >= 0.7 ? " bar-warn" : ""));
  const inner = el("span");
  inner.style.width = Math.min(100, Math.round(share * 100)) + "%";
  outer.appendChild(inner);
  const cell = el("span", null, "bar-cell");
  cell.appendChild(outer);
  cell.appendChild(el("span", Math.round(share * 100) + " %", "num"));
  return cell;
}

function renderKeys(v) {
  const section = document.getElementById("keys-section");
  section.hidden = !v.keys;
  if (!v.keys) return;
  const rows = v.keys.rows.map((k) => {
    const tr = row([k.id, usedOf(k.requests), usedOf(k.tokens),
      k.concurrent ? k.in_flight + " / " + k.concurrent : String(k.in_flight),
      dollars(k.budget_day_usd), dollars(k.budget_month_usd), bar(k.share)]);
    tr.dataset.key = k.id;
    return tr;
  });
  fill(document.querySelector("#keys tbody"), rows, "no key has limits", 7);
  document.getElementById("keys-total").textContent =
    "(" + v.keys.rows.length + " of " + v.keys.total + " keys with limits)";
}

function renderControl(v) {
  const c = document.getElementById("control");
  c.replaceChildren(v.control ? pill(v.control.state) : el("span", "none (legacy)", "muted"));
  const section = document.getElementById("control-section");
  section.hidden = !v.control;
  if (!v.control) return;
  const k = v.control;
  pairs(document.getElementById("control-pairs"), [
    ["Session", pill(k.state)],
    ["Mode", k.managed ? "managed" : "unmanaged"],
    ["Not ready because", k.unready],
    ["Projection generation", k.projection_generation],
    ["Issuer key (active)", k.issuer_active],
    ["Issuer key (staged)", k.issuer_staged ? k.issuer_staged[0] + ", active from " + new Date(k.issuer_staged[1]).toLocaleString() : ""],
    ["Nodes warned about the staged key", k.warned_nodes.length ? k.warned_nodes.join(", ") : "none"],
  ]);
}

function renderTraffic(v) {
  const now = Date.now();
  const t = v.traffic;
  if (previous && now > previous.at) {
    const dt = (now - previous.at) / 1000;
    const rps = (t.requests_ok + t.requests_failed - previous.t.requests_ok - previous.t.requests_failed) / dt;
    const eps = (t.requests_failed - previous.t.requests_failed) / dt;
    document.getElementById("rps").textContent = rps.toFixed(1);
    document.getElementById("eps").textContent = eps.toFixed(1);
  }
  previous = { at: now, t };
  const pair = (p) => (p ? p[0].toFixed(2) + " / " + p[1].toFixed(2) + " ms" : "–");
  document.getElementById("overhead").textContent = pair(t.overhead_ms);
  document.getElementById("ttft").textContent = pair(t.ttft_ms);
  const entries = [
    ["Requests answered", t.requests_ok],
    ["Requests failed", t.requests_failed],
  ];
  for (const [kind, n] of Object.entries(t.errors)) entries.push(["Errors: " + kind.replace(/_/g, " "), n]);
  entries.push(["Slow readers cut", t.slow_consumer_cuts]);
  entries.push(["Connections refused (cap)", t.connections_refused]);
  entries.push(["Wait timeouts", v.queue.timeouts]);
  pairs(document.getElementById("traffic"), entries);
}

function render(v) {
  last = v;
  document.getElementById("version").textContent = "version " + v.version;
  document.getElementById("queue-depth").textContent = v.queue.depth;
  document.getElementById("oldest-wait").textContent = ms(v.queue.oldest_wait_ms);
  document.getElementById("timeouts").textContent = v.queue.timeouts_last_minute;
  document.getElementById("leases").textContent = v.queue.leases;
  renderNodes(v);
  renderActions(v);
  renderProviders(v);
  renderKeys(v);
  renderControl(v);
  renderTraffic(v);
}

function selectNode(node) {
  selectedNode = selectedNode === node ? null : node;
  document.getElementById("probe-result").textContent = "";
  if (last) render(last);
}

function selectProvider(key) {
  selectedProvider = selectedProvider === key ? null : key;
  if (last) render(last);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("probe").addEventListener("click", probe);
  live(render);
});
