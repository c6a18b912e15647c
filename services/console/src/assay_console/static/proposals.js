// The open proposals' reviews: confirm, POST the JSON the API takes, show the outcome.
"use strict";
(function () {
  // A login session's CSRF token (none with a bearer token or an open console).
  function csrfToken() {
    const found = document.cookie.split("; ").find((c) => c.startsWith("assay_csrf="));
    return found ? found.slice("assay_csrf=".length) : "";
  }
  const box = document.getElementById("proposals");
  if (!box) return;
  const tenant = box.dataset.tenant;
  async function review(row, button) {
    if (!window.confirm(button.dataset.confirm)) return;
    const verb = button.dataset.verb;
    const outcome = row.querySelector(".outcome");
    const url = "/api/proposals/" + encodeURIComponent(row.dataset.proposal) + "/" + verb +
      "?tenant=" + encodeURIComponent(tenant);
    outcome.textContent = "sent; waiting for its outcome…";
    try {
      const res = await fetch(url, {
        method: "POST",
        headers: { "content-type": "application/json", "x-assay-csrf": csrfToken() },
        body: JSON.stringify({ workflow_id: row.dataset.workflow, reason: "from the console" }),
      });
      const answer = await res.json();
      if (res.status === 200) {
        outcome.textContent = verb + ": applied (" + answer.proposal.status + ")";
        for (const b of row.querySelectorAll("button")) b.disabled = true;
      } else if (res.status === 202) {
        outcome.textContent = verb + ": sent, not applied yet — reload to see it";
      } else if (res.status === 409) {
        // Already reviewed, or the owning stage refused it: say why.
        outcome.textContent = verb + ": not applied — " + answer.detail;
      } else {
        outcome.textContent = verb + " failed: " + answer.detail;
      }
      outcome.dataset.status = String(res.status);
    } catch (e) {
      outcome.textContent = verb + " failed: " + e;
    }
  }
  for (const row of box.querySelectorAll("tr.proposal")) {
    for (const button of row.querySelectorAll("button[data-verb]")) {
      button.addEventListener("click", function () { review(row, button); });
    }
  }
})();
