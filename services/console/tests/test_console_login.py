"""Logging in to the console with a token: the signed session cookie acts like the token
(its own tenant only), never holds it, carries the right flags, ends when it is tampered
with, signed under another key, or its token is removed; a cookie-authenticated action
needs the session's CSRF token; logging out clears it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from http.cookies import SimpleCookie

import httpx
import pytest
import pytest_asyncio

from assay.store.sqlite import SqliteEventLog
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.login import next_page
from assay_console.reads import ConsoleReads, SqliteRunsTable
from assay_console.sessions import CSRF_COOKIE, CSRF_HEADER, SESSION_COOKIE
from assay_console.stage import CONSOLE_EVENTS, RUNS_TABLE, fold_console
from services.console.tests.console_seed import TENANT_A, TENANT_B, run_ref, seed

TOKENS = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
SECRET = "a-session-key-for-tests"
FORM = {"content-type": "application/x-www-form-urlencoded"}
pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Served:
    reads: ConsoleReads

    def client(self, access: Access, base: str = "http://127.0.0.1") -> httpx.AsyncClient:
        app = create_app(self.reads, access)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    data = tmp_path_factory.mktemp("login")
    await seed(data, {TENANT_A: 3, TENANT_B: 2})
    store = data / "console.sqlite"
    log = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=(RUNS_TABLE,)).open()
    reads = ConsoleReads(log, SqliteRunsTable(store))
    yield Served(reads)
    await reads.close()
    await log.close()


def access(tokens: str = TOKENS, secret: str = SECRET) -> Access:
    return Access.parse(tokens, "token-admin", "127.0.0.1", secret)


async def login(c: httpx.AsyncClient, token: str, **headers: str) -> httpx.Response:
    return await c.post("/login", content=f"token={token}&next=/runs", headers={**FORM, **headers})


def cookies(response: httpx.Response) -> dict[str, SimpleCookie]:
    out = {}
    for header in response.headers.get_list("set-cookie"):
        jar: SimpleCookie = SimpleCookie()
        jar.load(header)
        out.update({name: jar for name in jar})
    return out


def session_of(response: httpx.Response) -> tuple[str, str]:
    got = cookies(response)
    return got[SESSION_COOKIE][SESSION_COOKIE].value, got[CSRF_COOKIE][CSRF_COOKIE].value


async def test_a_login_sets_a_signed_httponly_strict_session_without_the_token(
    served: Served,
) -> None:
    async with served.client(access()) as c:
        answer = await login(c, "token-a")
    assert answer.status_code == 303
    assert answer.headers["location"] == "/runs"
    got = cookies(answer)
    session = got[SESSION_COOKIE][SESSION_COOKIE]
    assert session["httponly"] is True
    assert session["samesite"] == "strict"
    assert session["path"] == "/"
    assert not session["secure"]  # plain http to a loopback address: the one exception
    assert "token-a" not in answer.headers.get("set-cookie", "")
    csrf = got[CSRF_COOKIE][CSRF_COOKIE]
    assert not csrf["httponly"]  # the console's own script sends it back
    assert csrf["samesite"] == "strict"


@pytest.mark.parametrize("base", ["https://127.0.0.1", "http://console.example", "http://10.0.0.5"])
async def test_the_cookie_is_secure_over_https_or_off_loopback(served: Served, base: str) -> None:
    async with served.client(access(), base) as c:
        answer = await login(c, "token-a")
    assert answer.status_code == 303
    got = cookies(answer)
    assert got[SESSION_COOKIE][SESSION_COOKIE]["secure"] is True
    assert got[CSRF_COOKIE][CSRF_COOKIE]["secure"] is True


async def test_the_session_acts_like_the_token_for_its_own_tenant(served: Served) -> None:
    async with served.client(access()) as c:
        session, _ = session_of(await login(c, "token-a"))
        jar = {"cookie": f"{SESSION_COOKIE}={session}"}
        runs = (await c.get("/api/runs", headers=jar)).json()["runs"]
        assert {r["run_id"] for r in runs} == {str(run_ref(TENANT_A, n).run_id) for n in range(3)}
        theirs = run_ref(TENANT_B, 0).run_id
        assert (await c.get(f"/api/runs/{theirs}", headers=jar)).status_code == 404
        other = await c.get("/api/runs", headers=jar, params={"tenant": str(TENANT_B)})
        assert other.status_code == 404
        page = await c.get(f"/runs/{run_ref(TENANT_A, 1).run_id}", headers=jar)
        assert page.status_code == 200


async def test_an_unknown_token_or_another_sites_form_opens_no_session(served: Served) -> None:
    async with served.client(access()) as c:
        unknown = await login(c, "token-z")
        assert unknown.status_code == 401
        assert "unknown token" in unknown.text
        forged = await login(c, "token-a", origin="https://evil.example")
        assert forged.status_code == 403
        cross = await login(c, "token-a", **{"sec-fetch-site": "cross-site"})
        assert cross.status_code == 403
        # A form under `Referrer-Policy: no-referrer` says `Origin: null`: only a
        # same-origin one (by `Sec-Fetch-Site`) passes.
        for site in ("cross-site", "same-site", None):
            fetch = {"sec-fetch-site": site} if site else {}
            nowhere = await login(c, "token-a", origin="null", **fetch)
            assert nowhere.status_code == 403, site
            assert SESSION_COOKIE not in cookies(nowhere)
        here = await login(c, "token-a", origin="null", **{"sec-fetch-site": "same-origin"})
        assert here.status_code == 303
        not_form = await c.post("/login", json={"token": "token-a"})
        assert not_form.status_code == 415
        for refused in (unknown, forged, cross, not_form):
            assert SESSION_COOKIE not in cookies(refused)


async def test_a_tampered_foreign_or_revoked_session_is_refused(served: Served) -> None:
    async with served.client(access()) as c:
        session, _ = session_of(await login(c, "token-a"))
    body, _, sig = session.partition(".")
    forged = (
        body.replace(body[5], "A" if body[5] != "A" else "B") + "." + sig,  # claims edited
        session + "x",  # signature edited
        "garbage",
    )
    async with served.client(access()) as c:
        for cookie in forged:
            answer = await c.get("/api/runs", headers={"cookie": f"{SESSION_COOKIE}={cookie}"})
            assert answer.status_code == 401, cookie
    # Under another key (a restarted console without a configured secret) it ends.
    async with served.client(access(secret="another-key")) as c:
        answer = await c.get("/api/runs", headers={"cookie": f"{SESSION_COOKIE}={session}"})
        assert answer.status_code == 401
    # With its token removed from the configuration it ends too.
    async with served.client(access(tokens=f"{TENANT_B}=token-b")) as c:
        answer = await c.get("/api/runs", headers={"cookie": f"{SESSION_COOKIE}={session}"})
        assert answer.status_code == 401


async def test_an_expired_session_is_refused(served: Served) -> None:
    short = Access.parse(TOKENS, None, "127.0.0.1", SECRET, session_ttl_s=60)
    claims_cookie = short.sessions.issue(TENANT_A, "0" * 64)
    assert short.sessions.open(claims_cookie) is not None
    expired = Access.parse(TOKENS, None, "127.0.0.1", SECRET, session_ttl_s=-1)
    assert expired.sessions.open(expired.sessions.issue(TENANT_A, "0" * 64)) is None


async def test_a_cookie_authenticated_action_needs_the_csrf_token(served: Served) -> None:
    run = run_ref(TENANT_A, 1).run_id
    async with served.client(access()) as c:
        session, csrf = session_of(await login(c, "token-a"))
        jar = {"cookie": f"{SESSION_COOKIE}={session}"}
        bare = await c.post(f"/api/runs/{run}/cancel", json={}, headers=jar)
        assert bare.status_code == 403
        assert CSRF_HEADER in bare.json()["detail"]
        wrong = await c.post(f"/api/runs/{run}/cancel", json={}, headers={**jar, CSRF_HEADER: "x"})
        assert wrong.status_code == 403
        # With the token it passes the guard and reaches the run, which has ended (409).
        right = await c.post(f"/api/runs/{run}/cancel", json={}, headers={**jar, CSRF_HEADER: csrf})
        assert right.status_code == 409
        assert "has ended" in right.json()["detail"]
        # Another session's CSRF token is not this one's.
        _, other = session_of(await login(c, "token-a"))
        crossed = await c.post(
            f"/api/runs/{run}/cancel", json={}, headers={**jar, CSRF_HEADER: other}
        )
        assert crossed.status_code == 403
        # A bearer token needs none: another site cannot make a browser send it.
        bearer = await c.post(
            f"/api/runs/{run}/cancel", json={}, headers={"authorization": "Bearer token-a"}
        )
        assert bearer.status_code == 409


async def test_logging_out_clears_the_cookies_and_needs_the_csrf_token(served: Served) -> None:
    async with served.client(access()) as c:
        session, csrf = session_of(await login(c, "token-a"))
        jar = {"cookie": f"{SESSION_COOKIE}={session}", **FORM}
        refused = await c.post("/logout", content="csrf=wrong", headers=jar)
        assert refused.status_code == 403
        out = await c.post("/logout", content=f"csrf={csrf}", headers=jar)
        assert out.status_code == 303
        cleared = cookies(out)
        assert cleared[SESSION_COOKIE][SESSION_COOKIE].value == ""
        assert cleared[CSRF_COOKIE][CSRF_COOKIE].value == ""


async def test_a_page_without_a_login_goes_to_the_login_page(served: Served) -> None:
    async with served.client(access()) as c:
        page = await c.get("/runs", params={"tenant": str(TENANT_A)})
        assert page.status_code == 303
        assert page.headers["location"] == f"/login?next=%2Fruns%3Ftenant%3D{TENANT_A}"
        api = await c.get("/api/runs")
        assert api.status_code == 401
        form = await c.get("/login", params={"next": "/runs"})
        assert form.status_code == 200
        assert 'name="next" value="/runs"' in form.text


async def test_after_a_login_only_a_page_of_this_console_is_next() -> None:
    assert next_page("/runs?tenant=x") == "/runs?tenant=x"
    for elsewhere in ("//evil.example/", "https://evil.example/", "/\\evil.example", "", None):
        assert next_page(elsewhere) == "/"
