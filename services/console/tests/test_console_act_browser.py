"""Acting from the console in a real headless Chromium (Debian's, driven by Playwright),
end to end on `assay serve-embedded`: a signal the run does not wait for is refused and
the page says why; a run waiting for approval is approved from its page, after a
confirmation, and the pipeline carries it on to its result."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Dialog, Page, expect, sync_playwright

from services.console.tests.console_seed import TENANT_A, TENANT_B
from services.console.tests.embedded_process import serve_embedded, until

CHROMIUM = os.environ.get("ASSAY_CHROMIUM", "/usr/bin/chromium")
A = {"authorization": "Bearer token-a"}
GATE = {
    "id": "gate",
    "steps": [
        {"id": "ask", "kind": "await", "signal": "approval", "timeout_s": 3600},
        {"id": "use", "kind": "tool", "tool": "strip", "args": {"text": "{{ steps.ask.output }}"}},
    ],
    "transitions": [{"from": "ask", "to": "use"}],
}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    with serve_embedded(tmp_path / "data", f"{TENANT_A}=token-a,{TENANT_B}=token-b") as found:
        yield found


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no chromium at {CHROMIUM}: `make chromium` installs Debian's")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(extra_http_headers=A)
        yield context.new_page()
        browser.close()


def waiting_run(client: httpx.Client, proc: subprocess.Popen[str]) -> str:
    def found() -> str | None:
        runs = client.get("/api/runs", headers=A, params={"state": "suspended"}).json()["runs"]
        return str(runs[0]["run_id"]) if runs else None

    return until(found, proc, 120)


def test_approving_a_waiting_run_from_its_page_takes_effect(
    served: tuple[str, subprocess.Popen[str]], page: Page, tmp_path: Path
) -> None:
    url, proc = served
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/api/workflows", json={"definition": GATE}, headers=A).is_success
        task = {"workflow_id": "gate", "idempotency_key": "needs-a-human", "input": {"n": 1}}
        assert client.post("/api/tasks", json=task, headers=A).status_code == 202
        run = waiting_run(client, proc)

        page.goto(f"{url}?tenant={TENANT_A}")
        page.click("a.waiting")
        page.wait_for_url("**state=suspended**")
        page.click(f"tr.run[data-run='{run}'] a")
        page.wait_for_url(f"**/runs/{run}**")
        asked: list[str] = []

        def confirm(dialog: Dialog) -> None:
            asked.append(dialog.message)
            dialog.accept()

        page.on("dialog", confirm)
        # A signal it does not wait for: execute refuses it, and the page says why.
        page.fill("#signal-form input[name=signal]", "poke")
        page.click("#signal-form button[type=submit]")
        expect(page.locator("#outcome")).to_contain_text(
            "signal: not applied — refused: ", timeout=30_000
        )
        expect(page.locator("#outcome")).to_contain_text("waits for 'approval', not 'poke'")
        assert page.locator("#outcome").get_attribute("data-status") == "409"
        page.click("#approve")
        expect(page.locator("#outcome")).to_contain_text("approve: applied", timeout=30_000)
        page.screenshot(path=tmp_path / "approved.png", full_page=True)
        assert asked == ["Send this signal to the run?", "Approve this run?"]

        def ended() -> dict[str, Any] | None:
            detail = client.get(f"/api/runs/{run}", headers=A).json()
            return detail if detail["run"]["status"] is not None else None

        detail = until(ended, proc, 120)
    states = [t["state"] for t in detail["timeline"]]
    assert states.index("suspended") < states.index("running", states.index("suspended"))
    assert detail["output"] == "approved"
