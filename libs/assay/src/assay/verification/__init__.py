"""Verification (§10): fail-closed verifiers over frozen episodes."""

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
