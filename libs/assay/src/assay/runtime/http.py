"""`/healthz` (liveness), `/readyz` (readiness) and Prometheus `/metrics` for one stage
process, on plain asyncio — and the stage's read-only queries (`StageSpec.queries`),
answered as JSON.

A few read-only endpoints do not justify a web framework; this serves HTTP/1.0
style request/response and closes the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Query = tuple[re.Pattern[str], Callable[[re.Match[str]], Awaitable[tuple[int, object]]]]
"""A read-only query: `GET` paths matching the pattern are answered with a status and a
JSON document."""
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 410: "Gone"}

Health = Callable[[], dict[str, object]]
"""Returns a JSON-able status; `"ok": False` makes /healthz answer 503."""


class StatusServer:
    """Serves /healthz and /metrics until closed."""

    def __init__(
        self,
        registry: CollectorRegistry,
        health: Health,
        port: int,
        refresh: Callable[[], Awaitable[None]] | None = None,
        *,
        readiness: Health | None = None,
        queries: Sequence[Query] = (),
    ) -> None:
        self.registry = registry
        self.health = health
        self.readiness = readiness
        """`/readyz`: `"ready": False` answers 503 (absent: the same as /healthz)."""
        self.port = port
        self.queries = tuple(queries)
        self.refresh = refresh
        """Called before each /metrics answer (gauges read from the stage's state)."""
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "0.0.0.0") -> int:
        """Listen; return the bound port (useful with port 0)."""
        self._server = await asyncio.start_server(self._serve, host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _query(
        self, path: str
    ) -> tuple[Callable[[re.Match[str]], Awaitable[tuple[int, object]]], re.Match[str]] | None:
        for pattern, answer in self.queries:
            if (match := pattern.fullmatch(path)) is not None:
                return answer, match
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            if path == "/healthz":
                status = self.health()
                body = json.dumps(status).encode()
                code = "200 OK" if status.get("ok") else "503 Service Unavailable"
                ctype = "application/json"
            elif path == "/readyz":
                status = (self.readiness or self.health)()
                body = json.dumps(status).encode()
                ready = status.get("ready", status.get("ok"))
                code = "200 OK" if ready else "503 Service Unavailable"
                ctype = "application/json"
            elif path == "/metrics":
                if self.refresh is not None:
                    await self.refresh()
                body, code, ctype = generate_latest(self.registry), "200 OK", CONTENT_TYPE_LATEST
            elif (found := self._query(path)) is not None:
                answer, match = found
                answered, doc = await answer(match)
                body, ctype = json.dumps(doc).encode(), "application/json"
                code = f"{answered} {REASONS.get(answered, 'Error')}"
            else:
                body, code, ctype = b"not found\n", "404 Not Found", "text/plain"
            writer.write(
                f"HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        except Exception:  # a status endpoint never takes the stage down
            log.warning("status request failed", exc_info=True)
        finally:
            writer.close()
