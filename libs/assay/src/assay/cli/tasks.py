"""Task files: JSON lines, each a `TaskSubmitted` or its `idempotency_key` and `input`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId, WorkflowId
from assay.kernel.schema import one_line
from assay.messages import TaskSubmitted


def read_tasks(
    path: Path, tenant: TenantId | None = None, workflow: WorkflowId | None = None
) -> list[TaskSubmitted]:
    """Every task of a JSONL file; `tenant` and `workflow` fill lines that lack them.

    Raises:
        AssayError: an unreadable file, or a line (named `path:n`) that is not a task.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise AssayError(f"{path}: {exc.strerror}") from exc
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc: Any = json.loads(line)
            if not isinstance(doc, dict):
                raise AssayError(f"{path}:{n}: not a task line (not a JSON object)")
            if tenant is not None:
                doc.setdefault("tenant", str(tenant))
            if workflow is not None:
                doc.setdefault("workflow_id", workflow)
            out.append(TaskSubmitted.model_validate(doc))
        except json.JSONDecodeError as exc:
            raise AssayError(f"{path}:{n}: not a task line (not JSON: {exc})") from exc
        except ValidationError as exc:
            raise AssayError(f"{path}:{n}: not a task line ({one_line(exc)})") from exc
    return out
