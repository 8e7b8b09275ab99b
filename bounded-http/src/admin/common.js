// Shared by the operators' pages: DOM helpers that build from text nodes only (never HTML from
// data), and one live connection to the page's event stream.
"use strict";

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function pill(word) {
  return el("span", word, "pill pill-" + String(word).replace(/[^a-z_]/g, ""));
}

function ago(ms) {
  if (!ms) return "–";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  const when = new Date(ms).toLocaleTimeString();
  if (s < 60) return when + " (" + s + " s ago)";
  if (s < 3600) return when + " (" + Math.round(s / 60) + " min ago)";
  return when + " (" + Math.round(s / 3600) + " h ago)";
}

function row(cells, cls) {
  const tr = el("tr", null, cls);
  for (const c of cells) {
    if (c instanceof Node) {
      const td = el("td");
      td.appendChild(c);
      tr.appendChild(td);
    } else if (typeof c === "number") {
      tr.appendChild(el("td", c, "num"));
    } else {
      tr.appendChild(el("td", c === undefined || c === null || c === "" ? "–" : c));
    }
  }
  return tr;
}

function fill(tbody, rows, empty, columns) {
  tbody.replaceChildren();
  for (const r of rows) tbody.appendChild(r);
  if (rows.length === 0) {
    const cells = [empty];
    for (let i = 1; i < columns; i++) cells.push("");
    tbody.appendChild(row(cells));
  }
}

// Opens the event stream and calls render(view) with every `status` event.
function live(render) {
  const badge = document.getElementById("live");
  const source = new EventSource("api/events");
  source.addEventListener("status", (e) => {
    badge.textContent = "live";
    badge.className = "pill pill-live";
    render(JSON.parse(e.data));
  });
  source.addEventListener("error", () => {
    badge.textContent = "reconnecting…";
    badge.className = "pill pill-down";
  });
}
