// iop-cp's status page (the helpers el, pill, row, fill, live are common.js's).
"use strict";

// "10:02:03 AM (5 s ago), generation 12", or what is known of it.
function when(ms, generation) {
  if (!ms && !generation) return "–";
  const g = generation ? "generation " + generation : "";
  return ms ? ago(ms) + (g ? ", " + g : "") : g;
}

function render(v) {
  document.getElementById("generation").textContent = v.generation;
  document.getElementById("edge-count").textContent = v.edges.length;
  document.getElementById("principal-count").textContent = v.principals.length;
  document.getElementById("token-count").textContent = v.tokens.filter((t) => !t.revoked).length;
  const active = v.issuer_keys.find((k) => k.active);
  const staged = v.issuer_keys.find((k) => !k.active);
  document.getElementById("issuer").textContent =
    (active ? active.id : "none") + (staged ? " → " + staged.id : "");

  fill(document.querySelector("#edges tbody"),
    v.edges.map((e) => {
      const tr = row([e.id, e.projection_generation, v.generation - e.projection_generation],
        "state-" + (e.projection_generation === v.generation ? "ready" : "pending"));
      tr.dataset.edge = e.id;
      return tr;
    }), "no Edge connected", 3);

  const principals = [];
  for (const p of v.principals) {
    const state = pill(p.enabled ? "enabled" : "disabled");
    const routes = p.routes.length ? p.routes : [null];
    routes.forEach((r, i) => {
      const first = i === 0;
      const tr = row([first ? p.id : "", first ? p.display_name : "", first ? state : "",
        first ? (p.limited ? "yes" : "no") : "",
        r ? r.id : "", r ? r.model : "", r ? r.slot_id : "", r ? r.upstream_target : ""]);
      tr.dataset.principal = p.id;
      principals.push(tr);
    });
  }
  fill(document.querySelector("#principals tbody"), principals, "no principal", 8);

  fill(document.querySelector("#tokens tbody"),
    v.tokens.map((t) => {
      const tr = row([t.id, t.principal_id, pill(t.revoked ? "revoked" : "active"),
        when(t.created_at_ms, t.created_generation)],
        "state-" + (t.revoked ? "down" : "ready"));
      tr.dataset.token = t.id;
      return tr;
    }), "no token", 4);

  fill(document.querySelector("#slots tbody"),
    v.slots.map((s) => {
      const tr = row([s.id, s.profile, s.header_name, s.revision, when(s.rotated_at_ms, s.rotated_generation),
        pill(s.enabled ? "enabled" : "disabled")]);
      tr.dataset.slot = s.id;
      return tr;
    }), "no credential slot", 6);

  fill(document.querySelector("#keys tbody"),
    v.issuer_keys.map((k) => row([k.id, pill(k.active ? "active" : "staged"),
      k.active ? "–" : new Date(k.activates_at_unix_ms).toLocaleString()])), "no issuer key", 3);

  fill(document.querySelector("#mutations tbody"),
    v.mutations.map((m) => row([m.generation, m.kind, m.object_id, ago(m.at_ms)])), "no mutation yet", 4);
}

document.addEventListener("DOMContentLoaded", () => live(render));
