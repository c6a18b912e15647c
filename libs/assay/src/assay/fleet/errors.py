"""Errors of fleet analysis. Each carries a message fit for one CLI line (exit code 2)."""

from __future__ import annotations

from assay.kernel.errors import AssayError


class FleetError(AssayError):
    """Bad fleet input: a trace, a manifest, a policy or a recording that cannot be used."""
