"""`/login` and `/logout`: a person gives a token once, the console sets a session
cookie (`sessions.py`) that acts like it; logging out clears it.

The login form posts from the console's own page, so a login from another site's page
is refused like any cross-site request (no logging a browser in as someone else).
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from jinja2 import Environment
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from assay_console.access import Access, is_loopback
from assay_console.actions import same_origin
from assay_console.app import Problem
from assay_console.sessions import CSRF_COOKIE, SESSION_COOKIE

MAX_FORM = 10_000


def secure(request: Request) -> bool:
    """Whether the cookie gets `Secure`: always, except over plain http to a loopback
    address (where a browser would not send it back)."""
    return request.url.scheme == "https" or not is_loopback(request.url.hostname or "")


def next_page(raw: str | None) -> str:
    """Where to go after logging in: a path of this console, else the overview."""
    if not raw or not raw.startswith("/") or raw.startswith("//") or "\\" in raw:
        return "/"
    parts = urlsplit(raw)
    return raw if not parts.scheme and not parts.netloc else "/"


async def form(request: Request) -> dict[str, str]:
    """The urlencoded form of a POST from the console's own page.

    Raises:
        Problem: 403 from another site; 415 not a form; 400 too large.
    """
    if request.headers.get("origin") == "null":
        # A form posted from a page served with `Referrer-Policy: no-referrer` (every
        # console page) says `Origin: null`; the browser's `Sec-Fetch-Site` still tells.
        if request.headers.get("sec-fetch-site") != "same-origin":
            raise Problem(403, "cross-site request refused")
    else:
        same_origin(request)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise Problem(415, "expected a form (application/x-www-form-urlencoded)")
    raw = await request.body()
    if len(raw) > MAX_FORM:
        raise Problem(400, "form too large")
    fields = parse_qs(raw.decode(errors="replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items()}


def login_routes(access: Access, env: Environment) -> list[Route]:
    """`GET /login` (the form), `POST /login` (sets the cookies), `POST /logout`."""

    def page(status: int, error: str | None, nxt: str) -> Response:
        body = env.get_template("login.html").render(
            error=error, next=nxt, open=access.open, tenant=None
        )
        return HTMLResponse(body, status_code=status)

    async def show(request: Request) -> Response:
        return page(200, None, next_page(request.query_params.get("next")))

    async def login(request: Request) -> Response:
        try:
            given = await form(request)
        except Problem as exc:
            return page(exc.status, exc.detail, "/")
        nxt = next_page(given.get("next"))
        if access.open:
            return page(400, "this console is open: it needs no login", nxt)
        opened = access.login(given.get("token", ""))
        if opened is None:
            return page(401, "unknown token", nxt)
        _, cookie = opened
        claims = access.sessions.open(cookie)
        assert claims is not None  # just issued
        answer = RedirectResponse(nxt, status_code=303)
        csrf = access.sessions.csrf(claims)
        pairs = ((SESSION_COOKIE, cookie, False), (CSRF_COOKIE, csrf, True))
        for name, value, script_reads in pairs:
            answer.set_cookie(
                name,
                value,
                max_age=access.sessions.ttl_s,
                path="/",
                secure=secure(request),
                httponly=not script_reads,
                samesite="strict",
            )
        return answer

    async def logout(request: Request) -> Response:
        try:
            given = await form(request)
        except Problem as exc:
            return page(exc.status, exc.detail, "/")
        claims = access.sessions.open(request.cookies.get(SESSION_COOKIE))
        if claims is not None and not access.sessions.csrf_matches(claims, given.get("csrf")):
            return page(403, "logging out needs the session's CSRF token", "/")
        answer = RedirectResponse("/login", status_code=303)
        for name in (SESSION_COOKIE, CSRF_COOKIE):
            answer.delete_cookie(name, path="/", secure=secure(request), samesite="strict")
        return answer

    return [
        Route("/login", show, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
    ]
