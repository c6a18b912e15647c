// Live refresh of the runs list's first page, only while the page is visible.
"use strict";
(function () {
  const table = document.getElementById("runs");
  if (!table || table.dataset.poll !== "1") return;
  const rows = document.getElementById("rows");
  const stamp = document.getElementById("updated");
  const every = 3000;
  async function refresh() {
    if (document.visibilityState !== "visible") return;
    try {
      const res = await fetch(window.location.href, { headers: { "x-console-poll": "1" } });
      if (!res.ok) return;
      rows.innerHTML = await res.text(); // server-rendered, autoescaped rows
      stamp.textContent = new Date().toISOString().replace("T", " ").slice(0, 19) + " UTC";
      table.dataset.refreshed = String(Number(table.dataset.refreshed || 0) + 1);
    } catch (e) { /* the next tick tries again */ }
  }
  setInterval(refresh, every);
  document.addEventListener("visibilitychange", refresh);
})();
