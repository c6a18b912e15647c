"""Failures of the infrastructure, told apart from failures of a message.

A handler that fails because Postgres ended its connection, S3 refused one or a
server restarts is not a handler that fails on its input: the message is fine
and must be handled again once the service is back, never dead-lettered. These
helpers name the first kind (`is_outage`), and `Outage` is what a stage raises
so that its consumer rewinds to the message and backs off without counting it
as a failure of the message. The protocol makes the repeat safe: a commit whose
outcome was unknown either landed (the inbox then drops the repeat) or did not.
"""

from __future__ import annotations

import errno
import sys

from assay.kernel.errors import AssayError

_S3_BUSY = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"}
_NETWORK = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.ETIMEDOUT,
}


class Outage(AssayError):
    """A service the stage depends on could not be reached; the message goes again later."""


def is_outage(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is a lost or refused connection
    to Postgres or S3, a server shutting down or starting up, or an S3 server error."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if _one(at):
            return True
        at = at.__cause__ or at.__context__
    return False


def _postgres() -> tuple[type[BaseException], ...]:
    """Postgres's lost or refused connections: none while asyncpg is not loaded (nothing
    can have raised one), so that embedded mode never loads it."""
    if "asyncpg" not in sys.modules:
        return ()
    import asyncpg

    return (
        asyncpg.PostgresConnectionError,  # class 08: the connection failed or does not exist
        asyncpg.exceptions.OperatorInterventionError,  # 57P01-03: shutdown, crash, starting up
        asyncpg.TooManyConnectionsError,
        asyncpg.InterfaceError,  # a connection the server ended, released back to its pool
        asyncpg.InternalClientError,  # a pooled connection caught mid-termination
    )


def _one(exc: BaseException) -> bool:
    if isinstance(exc, (Outage, ConnectionError, *_postgres())):
        return True
    if "botocore" not in sys.modules:  # as for asyncpg: no S3 client, no S3 error
        return isinstance(exc, OSError) and exc.errno in _NETWORK
    import botocore.exceptions

    if isinstance(exc, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
        return True
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or error.get("Code") in _S3_BUSY
    return isinstance(exc, OSError) and exc.errno in _NETWORK
