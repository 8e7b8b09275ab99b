// The Edge's status page (the helpers el, pill, ago, row, live are common.js's).
"use strict";

let selectedNode = null;
let last = null;
let previous = null; // { at: ms, traffic } for rates

function renderNodes(v) {
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren();
  for (const n of v.nodes) {
    const tr = row([n.id, pill(n.state), n.generation, ago(n.since_ms), n.in_flight, n.reason],
      "clickable state-" + n.state + (n.id === selectedNode ? " selected" : ""));
    tr.dataset.node = n.id;
    tr.tabIndex = 0;
    tr.addEventListener("click", () => select(n.id));
    tr.addEventListener("keydown", (e) => { if (e.key === "Enter") select(n.id); });
    body.appendChild(tr);
  }
  if (v.nodes.length === 0) {
    body.appendChild(row(["no Node has connected yet", "", "", "", "", ""]));
  }
  document.getElementById("nodes-ready").textContent =
    v.nodes.filter((n) => n.state === "ready" || n.state === "warned").length + " / " + v.nodes.length;
}

function renderProviders(v) {
  const body = document.querySelector("#providers tbody");
  body.replaceChildren();
  const shown = v.providers.filter((p) => selectedNode === null || p.node_id === selectedNode);
  for (const p of shown) {
    const tr = row([p.id, p.node_id, p.adapter, p.target, pill(p.health), p.capacity, p.in_flight,
      p.queued, p.long_capacity + " / " + p.long_in_flight + " / " + p.long_queued],
      "state-" + (p.health === "healthy" ? "ready" : "down"));
    tr.dataset.provider = p.id;
    body.appendChild(tr);
  }
  if (shown.length === 0) body.appendChild(row(["no provider", "", "", "", "", "", "", "", ""]));
  document.getElementById("provider-filter").textContent =
    selectedNode === null ? "(all Nodes)" : "(Node " + selectedNode + ")";
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
  const dl = document.getElementById("traffic");
  dl.replaceChildren();
  const pairs = [
    ["Requests answered", t.requests_ok],
    ["Requests failed", t.requests_failed],
    ["Slow readers cut", t.slow_consumer_cuts],
    ["Connections refused (cap)", t.connections_refused],
  ];
  for (const [k, val] of pairs) {
    dl.appendChild(el("dt", k));
    dl.appendChild(el("dd", val));
  }
}

function render(v) {
  last = v;
  document.getElementById("version").textContent = "version " + v.version;
  document.getElementById("queue-depth").textContent = v.queue.depth;
  document.getElementById("leases").textContent = v.queue.leases;
  const c = document.getElementById("control");
  c.replaceChildren(v.control ? pill(v.control.state) : el("span", "none (legacy)", "muted"));
  renderNodes(v);
  renderProviders(v);
  renderTraffic(v);
}

function select(node) {
  selectedNode = selectedNode === node ? null : node;
  if (last) render(last);
}

document.addEventListener("DOMContentLoaded", () => live(render));
