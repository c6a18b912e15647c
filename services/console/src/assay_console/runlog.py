"""A run's full log — its branches, steps, attempts and intents — which only the execute
stage holds, asked of execute rather than folded by the console.

Distributed, execute answers `GET /query/runs/<tenant>/<run>` on its status port
(`assay_execute.queries`; the console's `ASSAY_CONSOLE_EXECUTE_URL` names it).
Embedded, the console calls the same function, `assay.cli.runs.run_log`, over the
data directory's `execute.sqlite`. Either way the answer is the view
`assay runs show --json` prints, for the asking tenant only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import httpx

from assay.cli.runs import EXECUTE_LOG, run_log
from assay.engine.events import WORK_EVENTS, fold_work
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId
from assay.store.sqlite import SqliteEventLog

TIMEOUT_S = 3.0


class RunLogUnavailable(AssayError):
    """Execute could not answer for the run's log (unreachable, or the run was tiered)."""


class RunLog(Protocol):
    """Where the console asks for a run's full log."""

    async def view(self, tenant: TenantId, run_id: str) -> dict[str, Any] | None:
        """The run's log view (`RunView`'s JSON form); None: execute has no such run of
        the tenant.

        Raises:
            RunLogUnavailable: execute did not answer, or the run's records were tiered.
        """
        ...


def _answer(status: int, doc: Any) -> dict[str, Any] | None:
    if status == 200 and isinstance(doc, dict):
        return doc
    if status == 404:
        return None
    detail = doc.get("detail") if isinstance(doc, dict) else None
    raise RunLogUnavailable(str(detail or f"execute answered {status}"))


class DataDirRunLog:
    """Embedded: the data directory's execute log, read in this process."""

    def __init__(self, data_dir: Path) -> None:
        self._path = data_dir / EXECUTE_LOG

    async def view(self, tenant: TenantId, run_id: str) -> dict[str, Any] | None:
        if not self._path.is_file():
            raise RunLogUnavailable(f"no execute log in {self._path.parent}")
        log = await SqliteEventLog(self._path, WORK_EVENTS, fold_work).open()
        try:
            return _answer(*await run_log(log, tenant, run_id))
        finally:
            await log.close()


class HttpRunLog:
    """Distributed: execute's status port."""

    def __init__(self, base_url: str, timeout_s: float = TIMEOUT_S) -> None:
        self._base = base_url.rstrip("/")
        self._timeout_s = timeout_s

    async def view(self, tenant: TenantId, run_id: str) -> dict[str, Any] | None:
        url = f"{self._base}/query/runs/{tenant}/{run_id}"
        try:
            async with httpx.AsyncClient(timeout=self._timeout_s) as client:
                answer = await client.get(url)
            doc = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise RunLogUnavailable(f"execute at {self._base} did not answer: {exc}") from exc
        return _answer(answer.status_code, doc)
