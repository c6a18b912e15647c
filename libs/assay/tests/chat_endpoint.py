"""A scripted OpenAI-compatible chat-completions endpoint on loopback, for tests.

The server is the standard library's threading HTTP server on a free loopback
port; each test scripts its replies (status, headers, body, delay) — or answers
each request as it comes with a `respond` function — and reads back every
request it received. Nothing in httpx is replaced.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """One scripted answer: status, headers, raw body, and how long to wait first;
    `hang_up` closes the connection without answering (a gateway that went away)."""

    status: int = 200
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    delay_s: float = 0.0
    hang_up: bool = False


@dataclass(frozen=True)
class Seen:
    """One request the server received."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def completion(
    text: str = "The answer is 153.",
    *,
    prompt_tokens: int = 12,
    completion_tokens: int = 5,
    model: str = "local-model",
) -> dict[str, Any]:
    """A chat-completion body answering `text`, with its token counts."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def json_reply(doc: Any, status: int = 200, *headers: tuple[str, str]) -> Reply:
    """A reply carrying `doc` as JSON, with `status` and extra `headers`."""
    return Reply(status, json.dumps(doc).encode(), (("Content-Type", "application/json"), *headers))


OK = json_reply(completion())


class ChatServer:
    """A chat-completions endpoint on a free loopback port, serving while used as a
    context manager (or between `start()` and `stop()`).

    Replies are taken from the script in order; the last one repeats forever. With
    `respond` set, it answers every request instead (called on the server's threads).
    """

    def __init__(self, respond: Callable[[Seen], Reply] | None = None) -> None:
        self.script: list[Reply] = [OK]
        self.respond = respond
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._stopped = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def answer(self, *replies: Reply) -> None:
        with self._lock:
            self.script = list(replies)

    def take(self, seen: Seen) -> Reply:
        with self._lock:
            self.seen.append(seen)
            if self.respond is not None:
                return self.respond(seen)
            return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the port (a second call does nothing)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def stop_soon(self) -> None:
        """Stop from a request's own thread: the port closes once this request is done."""
        threading.Thread(target=self.stop, daemon=True).start()

    def __enter__(self) -> ChatServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that stopped waiting (its timeout, or a gateway hanging up on it) is
        not an error of the server's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler(chat: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            headers = {k.lower(): v for k, v in self.headers.items()}
            reply = chat.take(Seen(self.path, headers, json.loads(raw)))
            time.sleep(reply.delay_s)
            if reply.hang_up:
                self.close_connection = True
                return
            try:
                self.send_response(reply.status)
                for name, value in reply.headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped waiting (a timeout under test)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
