// Live refresh, only while the page is visible: the runs list's first page, a
// workflow's ladder while a challenger is live, and the overview's charts over time and
// its stages. The server renders (and escapes) the fragment; the script only swaps it in.
"use strict";
(function () {
  const every = 3000;
  function poll(container, target, src, period) {
    const stamp = document.getElementById("updated");
    async function refresh() {
      if (document.visibilityState !== "visible") return;
      try {
        const res = await fetch(src || window.location.href, { headers: { "x-console-poll": "1" } });
        if (!res.ok) return;
        target.innerHTML = await res.text(); // server-rendered, autoescaped
        if (stamp) stamp.textContent = new Date().toISOString().replace("T", " ").slice(0, 19) + " UTC";
        container.dataset.refreshed = String(Number(container.dataset.refreshed || 0) + 1);
      } catch (e) { /* the next tick tries again */ }
    }
    setInterval(refresh, period || every);
    document.addEventListener("visibilitychange", refresh);
  }
  // Logged in with a cookie: offer to log out, with the session's CSRF token.
  const csrf = (document.cookie.split("; ").find((c) => c.startsWith("assay_csrf=")) || "").slice(11);
  const logout = document.getElementById("logout");
  if (logout && csrf) {
    logout.elements.namedItem("csrf").value = csrf;
    logout.hidden = false;
  }
  const table = document.getElementById("runs");
  if (table && table.dataset.poll === "1") poll(table, document.getElementById("rows"));
  const ladder = document.getElementById("ladder");
  if (ladder && ladder.dataset.poll === "1") poll(ladder, ladder);
  // The overview's charts over time, each tenant's from its own fragment, less often
  // (each refresh reads the whole window).
  for (const series of document.querySelectorAll(".overview-series[data-poll='1']")) {
    poll(series, series, series.dataset.src, Number(series.dataset.every) || every);
  }
  // Each stage's health and lag (the overview's Stages section): its own fragment.
  const stages = document.getElementById("stages");
  if (stages && stages.dataset.poll) poll(stages, stages, stages.dataset.poll);
})();
