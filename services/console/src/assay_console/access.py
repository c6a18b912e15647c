"""Who a console request acts for: a tenant's bearer token, the admin token, a login
session opened with one of them (`sessions.py`), or — on a loopback address with no
token configured — an open console.

Tokens are kept only as blake3 digests; `ASSAY_CONSOLE_TOKENS` may give each as
`tenant=token` or, to keep it out of the environment too, `tenant=blake3:<hex>`.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass, field

from assay.kernel.canonical import digest
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId, tenant_id
from assay_console.sessions import DEFAULT_TTL_S, SessionClaims, SessionKeys


class AccessInvalid(AssayError):
    """The console's access settings do not parse, or would expose it without a token."""


@dataclass(frozen=True)
class Identity:
    """Whom a request acts for: one tenant, or (None) the administrator."""

    tenant: TenantId | None


@dataclass(frozen=True)
class Caller:
    """An identified request: whom it acts for, and the session when a cookie (not a
    bearer token) identified it — such a request must prove it is not forged."""

    who: Identity
    session: SessionClaims | None = None


def _hashed(secret: str) -> str:
    return (
        secret.removeprefix("blake3:") if secret.startswith("blake3:") else digest(secret.encode())
    )


@dataclass(frozen=True)
class Access:
    """The token table: digest -> identity. Empty and `open`: every request is admin."""

    tokens: tuple[tuple[str, Identity], ...]
    open: bool
    sessions: SessionKeys = field(default_factory=lambda: SessionKeys.of(None))

    @classmethod
    def parse(
        cls,
        tokens: str | None,
        admin_token: str | None,
        host: str,
        session_secret: str | None = None,
        session_ttl_s: int = DEFAULT_TTL_S,
    ) -> Access:
        """Build the table from the settings, for a console bound to `host`; login
        sessions are signed with `session_secret` (None: a key of this process).

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
        keys = SessionKeys.of(session_secret, session_ttl_s)
        return cls(tokens=tuple(table), open=not table, sessions=keys)

    def identify(self, authorization: str | None) -> Identity | None:
        """The identity of an `Authorization` header's bearer token; None: refused."""
        if self.open:
            return Identity(None)
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        return self.token(token)

    def token(self, token: str) -> Identity | None:
        """The identity of a token as given; None: not a known token."""
        presented = digest(token.strip().encode())
        found = None
        for hashed, who in self.tokens:  # compare every entry: no early exit to time
            if hmac.compare_digest(hashed, presented):
                found = who
        return found

    def caller(self, authorization: str | None, cookie: str | None) -> Caller | None:
        """Who a request acts for: its bearer token if it sends one, else its session
        cookie; None: neither identifies anyone."""
        if self.open or authorization is not None:
            who = self.identify(authorization)
            return Caller(who) if who is not None else None
        claims = self.sessions.open(cookie)
        if claims is None:
            return None
        found = None
        for hashed, who in self.tokens:  # the token it was opened with is still configured
            same = hmac.compare_digest(self.sessions.fingerprint(hashed), claims.key)
            if same and who.tenant == claims.who():
                found = Caller(who, claims)
        return found

    def login(self, token: str) -> tuple[Identity, str] | None:
        """A session cookie for `token`, and whom it acts for; None: not a known token."""
        who = self.token(token)
        if who is None:
            return None
        return who, self.sessions.issue(who.tenant, digest(token.strip().encode()))


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
