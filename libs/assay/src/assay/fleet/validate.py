"""Strict reading of a trace: every line checked, every problem named by file, line and rule.

The rules, as named in errors:

- `json`: a line is not a JSON object.
- `header`: the first line is not a trace header, or a header appears later.
- `version`: the header names a format version this code does not know.
- `resources`: the declared CPU cores or memory are missing, not positive, or absurd.
- `schema`: an event line has an unknown type, a missing field or a field the format lacks.
- `order`: a timestamp goes back.
- `transition`: an event the run's state does not allow (anything before `run_started`
  or after `run_finished`, a `wait_finished` of another kind than the open wait, ...).
- `overlap`: a wait starts while another wait or a busy period is open, or a busy period
  while a wait is (a wait asserts the sandbox is idle: nothing may run in it).
- `unfinished`: the run finishes — or the file ends — with a wait or busy period open,
  or the file ends before `run_finished`.
- `empty`: no header at all.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, assert_never

from pydantic import ValidationError

from assay.fleet.errors import FleetError
from assay.fleet.trace import (
    EVENT,
    TRACE_FORMAT,
    TRACE_VERSION,
    BusyFinishedEvent,
    BusyStartedEvent,
    RunFinishedEvent,
    RunStartedEvent,
    Trace,
    TraceEvent,
    TraceHeader,
    WaitFinishedEvent,
    WaitKind,
    WaitStartedEvent,
)

MAX_ISSUES = 50
"""Problems reported per file before the rest are summarised."""


@dataclass(frozen=True)
class Issue:
    """One problem: where it is and which rule it breaks."""

    source: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.rule}: {self.message}"


class TraceInvalid(FleetError):
    """A trace breaks the format's rules; `issues` holds every problem found."""

    def __init__(self, issues: list[Issue]) -> None:
        self.issues = issues
        more = f" (+{len(issues) - 1} more)" if len(issues) > 1 else ""
        super().__init__(f"{issues[0]}{more}")


class _State(enum.Enum):
    BEFORE = "before run_started"
    ACTIVE = "active"
    WAITING = "waiting"
    BUSY = "busy"
    FINISHED = "finished"


def parse_trace(text: str, source: str) -> Trace:
    """The trace in `text` (named `source` in errors), validated.

    Raises:
        TraceInvalid: any rule of the format is broken; every problem is listed.
    """
    issues: list[Issue] = []
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise TraceInvalid([Issue(source, 1, "empty", "no header: the file is empty")])
    header = _header(lines[0], source, issues)
    checker = _Checker(source, issues)
    for n, raw in enumerate(lines[1:], start=2):
        doc = _object(raw, source, n, issues)
        if doc is None:
            continue
        if doc.get("type") == "header":
            issues.append(Issue(source, n, "header", "a second header"))
            continue
        try:
            event = EVENT.validate_python(doc)
        except ValidationError as exc:
            issues.append(Issue(source, n, "schema", _first(exc)))
            continue
        checker.feed(n, event)
    checker.end(len(lines) + 1)
    if issues:
        raise TraceInvalid(issues[:MAX_ISSUES])
    assert header is not None  # a missing header is an issue
    return Trace(header, tuple(checker.events))


def _object(raw: str, source: str, n: int, issues: list[Issue]) -> dict[str, Any] | None:
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        issues.append(Issue(source, n, "json", f"not JSON: {exc.msg}"))
        return None
    if not isinstance(doc, dict):
        issues.append(Issue(source, n, "json", "not a JSON object"))
        return None
    return doc


def _header(raw: str, source: str, issues: list[Issue]) -> TraceHeader | None:
    doc = _object(raw, source, 1, issues)
    if doc is None:
        return None
    if doc.get("type") != "header" or doc.get("format") != TRACE_FORMAT:
        issues.append(Issue(source, 1, "header", f"the first line must be a {TRACE_FORMAT} header"))
        return None
    if doc.get("version") != TRACE_VERSION:
        issues.append(
            Issue(
                source,
                1,
                "version",
                f"unknown trace version {doc.get('version')!r} (this reads {TRACE_VERSION})",
            )
        )
        return None
    try:
        return TraceHeader.model_validate(doc)
    except ValidationError as exc:
        fields = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
        rule = "resources" if fields & {"cpu_cores", "memory_gib"} else "schema"
        issues.append(Issue(source, 1, rule, _first(exc)))
        return None


def _first(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(line)"
    return f"{where}: {first['msg']}"


class _Checker:
    """The run's state machine over event lines, in file order."""

    def __init__(self, source: str, issues: list[Issue]) -> None:
        self.source = source
        self.issues = issues
        self.state = _State.BEFORE
        self.open_kind: WaitKind | None = None
        self.last_ms = 0
        self.events: list[TraceEvent] = []

    def _refuse(self, n: int, rule: str, message: str) -> None:
        self.issues.append(Issue(self.source, n, rule, message))

    def feed(self, n: int, e: TraceEvent) -> None:
        if self.events and e.t_ms < self.last_ms:
            self._refuse(n, "order", f"t_ms {e.t_ms} is before the previous event's {self.last_ms}")
            return
        if self._allowed(n, e):
            self.last_ms = e.t_ms
            self.events.append(e)

    def _allowed(self, n: int, e: TraceEvent) -> bool:
        state = self.state
        if state is _State.BEFORE and not isinstance(e, RunStartedEvent):
            self._refuse(n, "transition", f"{e.type} before run_started")
            return False
        if state is _State.FINISHED:
            self._refuse(n, "transition", f"{e.type} after run_finished")
            return False
        match e:
            case RunStartedEvent():
                if state is not _State.BEFORE:
                    self._refuse(n, "transition", "a second run_started")
                    return False
                self.state = _State.ACTIVE
            case WaitStartedEvent(kind=kind):
                if state is _State.WAITING or state is _State.BUSY:
                    what = "wait" if state is _State.WAITING else "busy period"
                    self._refuse(n, "overlap", f"{kind.value} wait starts while a {what} is open")
                    return False
                self.state, self.open_kind = _State.WAITING, kind
            case WaitFinishedEvent(kind=kind):
                if state is not _State.WAITING:
                    self._refuse(n, "transition", f"{kind.value} wait_finished with no open wait")
                    return False
                if kind is not self.open_kind:
                    assert self.open_kind is not None
                    self._refuse(
                        n,
                        "transition",
                        f"{kind.value} wait_finished, but the open wait is {self.open_kind.value}",
                    )
                    return False
                self.state, self.open_kind = _State.ACTIVE, None
            case BusyStartedEvent():
                if state is _State.WAITING or state is _State.BUSY:
                    what = "wait" if state is _State.WAITING else "busy period"
                    self._refuse(n, "overlap", f"busy period starts while a {what} is open")
                    return False
                self.state = _State.BUSY
            case BusyFinishedEvent():
                if state is not _State.BUSY:
                    self._refuse(n, "transition", "busy_finished with no open busy period")
                    return False
                self.state = _State.ACTIVE
            case RunFinishedEvent():
                if state is _State.WAITING or state is _State.BUSY:
                    self._refuse(n, "unfinished", f"run_finished while {self._open()} is open")
                    self.state = _State.FINISHED  # said once, not again at the end of the file
                    return False
                self.state = _State.FINISHED
            case _:
                assert_never(e)
        return True

    def _open(self) -> str:
        if self.state is _State.WAITING:
            assert self.open_kind is not None
            return f"a {self.open_kind.value} wait"
        return "a busy period"

    def end(self, n: int) -> None:
        match self.state:
            case _State.FINISHED:
                return
            case _State.BEFORE:
                self._refuse(n, "unfinished", "the file ends before run_started")
            case _State.WAITING | _State.BUSY:
                self._refuse(n, "unfinished", f"the file ends while {self._open()} is open")
            case _State.ACTIVE:
                self._refuse(n, "unfinished", "the file ends before run_finished")
            case _:
                assert_never(self.state)
