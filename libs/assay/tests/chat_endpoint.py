"""A scripted OpenAI-compatible chat-completions endpoint on loopback, for tests.

The server is the standard library's threading HTTP server on a free loopback
port; each test scripts its replies (status, headers, body, delay) and reads
back every request it received. Nothing in httpx is replaced.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """One scripted answer: status, headers, raw body, and how long to wait first."""

    status: int = 200
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    delay_s: float = 0.0


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

    Replies are taken from the script in order; the last one repeats forever.
    """

    def __init__(self) -> None:
        self.script: list[Reply] = [OK]
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def answer(self, *replies: Reply) -> None:
        with self._lock:
            self.script = list(replies)

    def take(self, seen: Seen) -> Reply:
        with self._lock:
            self.seen.append(seen)
            return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ChatServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler(chat: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            headers = {k.lower(): v for k, v in self.headers.items()}
            reply = chat.take(Seen(self.path, headers, json.loads(raw)))
            time.sleep(reply.delay_s)
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
