// The run page's actions: confirm, POST the JSON the API takes, show the outcome.
"use strict";
(function () {
  // A login session's CSRF token (none with a bearer token or an open console).
  function csrfToken() {
    const found = document.cookie.split("; ").find((c) => c.startsWith("assay_csrf="));
    return found ? found.slice("assay_csrf=".length) : "";
  }
  const box = document.getElementById("actions");
  if (!box) return;
  const outcome = document.getElementById("outcome");
  const tenant = box.dataset.tenant;
  async function act(action, question, body) {
    if (!window.confirm(question)) return;
    const url = "/api/runs/" + encodeURIComponent(box.dataset.run) + "/" + action +
      "?tenant=" + encodeURIComponent(tenant);
    outcome.textContent = "sent; waiting for its outcome…";
    try {
      const res = await fetch(url, {
        method: "POST",
        headers: { "content-type": "application/json", "x-assay-csrf": csrfToken() },
        body: JSON.stringify(body),
      });
      const answer = await res.json();
      if (res.status === 200) {
        outcome.textContent = action + ": applied (run now " + answer.run.state + ")";
      } else if (res.status === 202) {
        outcome.textContent = action + ": sent, not applied yet — reload to see it";
      } else if (res.status === 409) {
        // Not in a state it applies to, or the owning stage refused it: say why.
        outcome.textContent = action + ": not applied — " + answer.detail;
      } else {
        outcome.textContent = action + " failed: " + answer.detail;
      }
      outcome.dataset.status = String(res.status);
    } catch (e) {
      outcome.textContent = action + " failed: " + e;
    }
  }
  for (const button of box.querySelectorAll("button[data-action]")) {
    button.addEventListener("click", function () {
      const body = button.dataset.action === "approve" ? {} : { reason: "from the console" };
      act(button.dataset.action, button.dataset.confirm, body);
    });
  }
  const form = document.getElementById("signal-form");
  if (form) {
    form.addEventListener("submit", function (e) {
      e.preventDefault();
      const data = new FormData(form);
      act("signal", form.dataset.confirm, { signal: data.get("signal"), payload: data.get("payload") });
    });
  }
})();
