"""Typed errors the kernel raises. Each carries a message fit for one CLI line."""

from __future__ import annotations


class AssayError(Exception):
    """Base of every error Assay raises on purpose."""


class IllegalTransition(AssayError):
    """A state machine was asked for a transition its table does not hold."""

    def __init__(self, machine: str, frm: object, to: object, why: str = "") -> None:
        detail = f": {why}" if why else ""
        super().__init__(f"illegal {machine} transition {frm} -> {to}{detail}")
        self.frm = frm
        self.to = to


class Refused(AssayError):
    """Input that can never be processed: it goes to the stage's dead-letter topic.

    The reason is recorded with the original bytes. Raising it from a handler
    never retries and never crashes the consumer.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
