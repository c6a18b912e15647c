"""Login sessions: a person gives a token once on `/login` and the console sets a cookie
that acts like it until it expires, the person logs out, or the token is removed.

The session cookie (`assay_session`) never holds the token: it holds whom it acts for,
a fingerprint of the token's digest (an HMAC under the session key, so removing the
token from `ASSAY_CONSOLE_TOKENS` ends its sessions), an expiry and a random nonce,
signed with HMAC-SHA256 under `ASSAY_CONSOLE_SESSION_SECRET` (or a random key made when
the process starts: sessions then end when it restarts and are not shared between
replicas). It is HttpOnly, SameSite=Strict, and Secure unless the console is reached
over plain http on a loopback address (a browser would not send a Secure cookie there).

Cross-site request forgery, for requests a cookie authenticates: a signed double-submit
token. The `assay_csrf` cookie, readable by the console's own script, carries an HMAC of
the session's nonce; a state change must send it back in the `X-Assay-CSRF` header (or
a form's `csrf` field), and the console recomputes it from the session cookie. Another
site can neither read the cookie nor forge the value.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from assay.kernel.ids import TenantId, tenant_id

SESSION_COOKIE = "assay_session"
CSRF_COOKIE = "assay_csrf"
CSRF_HEADER = "x-assay-csrf"
DEFAULT_TTL_S = 12 * 3600


class SessionClaims(BaseModel):
    """What a session cookie says, once its signature checks."""

    tenant: str | None
    """The tenant it acts for; None: the administrator."""
    key: str
    """The fingerprint of the token it was opened with."""
    expires: int
    """Unix seconds."""
    nonce: str

    def who(self) -> TenantId | None:
        return tenant_id(self.tenant) if self.tenant is not None else None


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, repr=False)
class SessionKeys:
    """The key that signs sessions and CSRF tokens, and how long a session lasts."""

    secret: bytes
    ttl_s: int = DEFAULT_TTL_S

    @classmethod
    def of(cls, secret: str | None, ttl_s: int = DEFAULT_TTL_S) -> SessionKeys:
        """Sessions signed with `secret`; None: a random key for this process only."""
        key = secret.encode() if secret else secrets.token_bytes(32)
        return cls(key, ttl_s)

    def _mac(self, purpose: str, text: str) -> str:
        return _b64(hmac.new(self.secret, f"{purpose}:{text}".encode(), hashlib.sha256).digest())

    def fingerprint(self, token_digest: str) -> str:
        """A token digest's stand-in inside a cookie."""
        return self._mac("key", token_digest)[:22]

    def issue(self, tenant: TenantId | None, token_digest: str) -> str:
        """A signed session cookie's value."""
        claims = SessionClaims(
            tenant=str(tenant) if tenant is not None else None,
            key=self.fingerprint(token_digest),
            expires=int(time.time()) + self.ttl_s,
            nonce=secrets.token_urlsafe(16),
        )
        body = _b64(claims.model_dump_json().encode())
        return f"{body}.{self._mac('session', body)}"

    def open(self, cookie: str | None) -> SessionClaims | None:
        """The claims of a cookie whose signature checks and which has not expired."""
        body, _, sig = (cookie or "").partition(".")
        if not body or not hmac.compare_digest(sig, self._mac("session", body)):
            return None
        try:
            claims = SessionClaims.model_validate(json.loads(_unb64(body)))
        except (binascii.Error, ValueError, ValidationError):
            return None
        return claims if claims.expires > time.time() else None

    def csrf(self, claims: SessionClaims) -> str:
        """The CSRF token of a session."""
        return self._mac("csrf", claims.nonce)

    def csrf_matches(self, claims: SessionClaims, given: str | None) -> bool:
        """Whether `given` is the session's CSRF token."""
        return given is not None and hmac.compare_digest(given, self.csrf(claims))
