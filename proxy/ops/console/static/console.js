// stepguard console: the holds queue's live update and the live violations feed.
// Loaded as a file (the Content-Security-Policy allows no inline script); writes text only
// (textContent), never HTML, so nothing from the store is ever parsed as markup.
"use strict";

function watchHolds(table) {
  const url = table.dataset.live;
  const notice = document.getElementById("holds-notice");
  async function check() {
    let open;
    try {
      const answer = await fetch(url, {credentials: "same-origin", cache: "no-store"});
      if (!answer.ok) { return; }
      open = new Set((await answer.json()).open);
    } catch (e) { return; }
    const shown = new Set();
    for (const row of table.querySelectorAll("tr.hold")) {
      shown.add(row.dataset.decision);
      if (!open.has(row.dataset.decision)) { row.classList.add("decided"); }
    }
    const fresh = [...open].filter((id) => !shown.has(id)).length;
    if (fresh > 0) {
      notice.hidden = false;
      notice.textContent = fresh + " new held call(s): reload the page to decide them.";
    }
  }
  setInterval(check, 2000);
}

function tickHolds(table) {
  setInterval(() => {
    for (const cell of table.querySelectorAll("td.left[data-until]")) {
      const left = Math.floor(Number(cell.dataset.until) - Date.now() / 1000);
      if (left <= 0) { cell.textContent = "expired"; continue; }
      const m = Math.floor(left / 60), s = left % 60;
      cell.textContent = m ? m + "m " + String(s).padStart(2, "0") + "s" : s + "s";
    }
  }, 1000);
}

function watchFeed(table) {
  const body = table.querySelector("tbody");
  const state = document.getElementById("feed-state");
  const source = new EventSource(table.dataset.stream);
  source.onopen = () => { state.textContent = "Listening: new violations and refusals appear at the top."; };
  source.onerror = () => { state.textContent = "Disconnected: reconnecting…"; };
  source.onmessage = (message) => {
    const item = JSON.parse(message.data);
    const row = document.createElement("tr");
    row.className = "new violation";
    const check = item.check ? item.check + " (" + (item.drift || "-") + ")" : "-";
    const cells = [item.time, null, item.step, item.boundary, item.verdict, item.action, check, item.detail];
    cells.forEach((value, i) => {
      const cell = document.createElement("td");
      if (i === 1) {
        const link = document.createElement("a");
        link.href = "/ui/runs/" + encodeURIComponent(item.run_id);
        link.textContent = item.run_id + " (" + item.workflow + ")";
        cell.appendChild(link);
      } else {
        cell.textContent = value === null || value === undefined ? "-" : String(value);
      }
      row.appendChild(cell);
    });
    body.insertBefore(row, body.firstChild);
    while (body.rows.length > 500) { body.deleteRow(body.rows.length - 1); }
    if (item.dropped) { state.textContent = "Listening (" + item.dropped + " event(s) dropped: the page fell behind)."; }
  };
}

document.addEventListener("DOMContentLoaded", () => {
  const holds = document.getElementById("holds");
  if (holds) { watchHolds(holds); tickHolds(holds); }
  const feed = document.getElementById("feed");
  if (feed) { watchFeed(feed); }
});
