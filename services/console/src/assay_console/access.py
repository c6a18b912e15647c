"""Who a console request acts for: a tenant's bearer token, the admin token, or — on a
loopback address with no token configured — an open console.

Tokens are kept only as blake3 digests; `ASSAY_CONSOLE_TOKENS` may give each as
`tenant=token` or, to keep it out of the environment too, `tenant=blake3:<hex>`.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from assay.kernel.canonical import digest
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId, tenant_id


class AccessInvalid(AssayError):
    """The console's access settings do not parse, or would expose it without a token."""


@dataclass(frozen=True)
class Identity:
    """Whom a request acts for: one tenant, or (None) the administrator."""

    tenant: TenantId | None


def _hashed(secret: str) -> str:
    return (
        secret.removeprefix("blake3:") if secret.startswith("blake3:") else digest(secret.encode())
    )


@dataclass(frozen=True)
class Access:
    """The token table: digest -> identity. Empty and `open`: every request is admin."""

    tokens: tuple[tuple[str, Identity], ...]
    open: bool

    @classmethod
    def parse(cls, tokens: str | None, admin_token: str | None, host: str) -> Access:
        """Build the table from the settings, for a console bound to `host`.

        Raises:
            AccessInvalid: a pair is not `tenant=token`, a tenant is not a UUID, or no
                token is configured and `host` is not a loopback address.
        """
        table: list[tuple[str, Identity]] = []
        for pair in (tokens or "").split(","):
            if not pair.strip():
                continue
            tenant, sep, secret = pair.strip().partition("=")
            if not sep or not secret:
                raise AccessInvalid("ASSAY_CONSOLE_TOKENS: each entry is tenant=token")
            try:
                who = tenant_id(tenant)
            except ValueError as exc:
                raise AccessInvalid(f"ASSAY_CONSOLE_TOKENS: {tenant!r} is not a UUID") from exc
            table.append((_hashed(secret), Identity(who)))
        if admin_token:
            table.append((_hashed(admin_token), Identity(None)))
        if not table and not is_loopback(host):
            raise AccessInvalid(
                f"refusing to serve the console on {host} without a token: set "
                "ASSAY_CONSOLE_TOKENS or ASSAY_CONSOLE_ADMIN_TOKEN, or bind to 127.0.0.1"
            )
        return cls(tokens=tuple(table), open=not table)

    def identify(self, authorization: str | None) -> Identity | None:
        """The identity of an `Authorization` header's bearer token; None: refused."""
        if self.open:
            return Identity(None)
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        presented = digest(token.strip().encode())
        found = None
        for hashed, who in self.tokens:  # compare every entry: no early exit to time
            if hmac.compare_digest(hashed, presented):
                found = who
        return found


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
