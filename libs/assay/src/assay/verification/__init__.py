"""Verification (§10): fail-closed verifiers over frozen episodes."""

from assay.verification.verifiers import (
    BUILTIN_VERIFIERS,
    ExactVerifier,
    JsonSchemaVerifier,
    RegexVerifier,
    Verifier,
    verify_episode,
)

__all__ = [
    "BUILTIN_VERIFIERS",
    "ExactVerifier",
    "JsonSchemaVerifier",
    "RegexVerifier",
    "Verifier",
    "verify_episode",
]
