"""A loopback TCP proxy that a fault test can cut, as a network partition would.

While cut, every connection through it is reset and every new one is reset as soon
as it is accepted; `heal` lets traffic through again. It runs on a thread of its own,
so synchronous and asynchronous tests drive it alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit


class FaultProxy:
    """Forwards `127.0.0.1:<port>` to `target` until cut."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._cut = False
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @classmethod
    def for_url(cls, url: str) -> FaultProxy:
        """A proxy for the host and port of an http(s) URL."""
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 80)

    def url_of(self, url: str) -> str:
        """`url` with its host and port replaced by this proxy's."""
        parts = urlsplit(url)
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{self.port}"))

    def start(self) -> FaultProxy:
        """Listen on a free loopback port (`port`)."""
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop
        ).result(10)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def cut(self) -> None:
        """Reset every open connection and every new one until `heal`."""
        self._cut = True
        asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop).result(10)

    def heal(self) -> None:
        """Let connections through again."""
        self._cut = False

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """Cut for the block, then heal."""
        self.cut()
        try:
            yield
        finally:
            self.heal()

    def stop(self) -> None:
        """Close everything and end the thread."""

        async def close() -> None:
            await self._reset_all()
            if self._server is not None:
                self._server.close()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _reset_all(self) -> None:
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )
        for w in (writer, up_writer):
            self._open.discard(w)
            w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.transport.abort()
