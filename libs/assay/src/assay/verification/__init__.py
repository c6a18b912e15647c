"""Verification (§10): fail-closed verifiers over frozen episodes."""

from typing import TYPE_CHECKING

from assay.kernel.lazy import lazy_exports

if TYPE_CHECKING:
    from assay.verification.command import CommandVerifier
    from assay.verification.verifiers import (
        BUILTIN_VERIFIERS,
        ExactVerifier,
        JsonSchemaVerifier,
        RegexVerifier,
        Verifier,
        verifier_registry,
        verify_episode,
    )
else:
    __getattr__ = lazy_exports(
        __name__,
        {
            "assay.verification.command": ["CommandVerifier"],
            "assay.verification.verifiers": [
                "BUILTIN_VERIFIERS",
                "ExactVerifier",
                "JsonSchemaVerifier",
                "RegexVerifier",
                "Verifier",
                "verifier_registry",
                "verify_episode",
            ],
        },
    )

__all__ = [
    "BUILTIN_VERIFIERS",
    "CommandVerifier",
    "ExactVerifier",
    "JsonSchemaVerifier",
    "RegexVerifier",
    "Verifier",
    "verifier_registry",
    "verify_episode",
]
