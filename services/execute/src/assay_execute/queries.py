"""What execute answers on its HTTP port, read-only, for what only it holds: a run's full
log (its branches, steps, attempts and intents), for the console's run page.

`GET /query/runs/<tenant>/<run>` answers the view `assay runs show --json` prints, for
that tenant only: another tenant's run answers 404 exactly like a missing one. The
port is the stage's status port (`ASSAY_HTTP_PORT`), inside the deployment's network.
"""

from __future__ import annotations

import re

from assay.cli.runs import run_log
from assay.kernel.ids import is_run_id, tenant_id
from assay.runtime.stage import StageQuery
from assay.store.ports import EventLog

RUN_LOG_PATH = re.compile(r"/query/runs/(?P<tenant>[^/]+)/(?P<run>[^/]+)")


async def answer_run_log(log: EventLog, match: re.Match[str]) -> tuple[int, object]:
    """A run's log view for the tenant the path names; 400 for a malformed id."""
    try:
        tenant = tenant_id(match["tenant"])
    except ValueError:
        return 400, {"detail": f"tenant {match['tenant']!r} is not a UUID"}
    if not is_run_id(match["run"]):
        return 400, {"detail": f"run id {match['run']!r} is not a ULID"}
    return await run_log(log, tenant, match["run"])


QUERIES = (StageQuery(RUN_LOG_PATH, answer_run_log),)
