"""A Postgres server for development and tests: from the environment, a container, the
server already on this machine, or a throwaway `initdb` cluster."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from assay.devstack.base import (
    InfraUnavailable,
    Service,
    docker_available,
    free_port,
    log_file,
    port_open,
    run_apart,
    wait_for_port,
)

DATABASE_URL_ENV = "ASSAY_TEST_DATABASE_URL"
POSTGRES_IMAGE = "postgres:15-alpine"
LOCAL_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
_START_TIMEOUT_S = 30.0
_SETTINGS = ("-c", "listen_addresses=127.0.0.1", "-c", "fsync=on")
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def resolve_postgres(workdir: Path) -> Service:
    """Find or start a Postgres server and return its superuser DSN as `.address`.

    In order: the DSN in `ASSAY_TEST_DATABASE_URL`; a `PostgresContainer` when a
    Docker engine answers; the server on 127.0.0.1:5432 when it accepts the
    `postgres` superuser (borrowed: `stop()` leaves it running); a throwaway
    cluster made with `initdb` from `/usr/lib/postgresql/*/bin`, run as a child
    process on a free loopback port (as the `postgres` OS user when this process
    is root, which Postgres refuses to run as). A started server ends at `stop()`.

    Args:
        workdir: where a throwaway cluster keeps its data and log.

    Raises:
        InfraUnavailable: none of the four could be had; the message says why each failed.
    """
    url = os.environ.get(DATABASE_URL_ENV)
    if url:
        return Service("postgres", url)
    reasons: list[str] = []
    if docker_available():
        try:
            return _start_container()
        except Exception as exc:  # an image pull or a start failed: try the next way
            reasons.append(f"Postgres container: {exc}")
    else:
        reasons.append("Postgres container: no Docker engine answers")
    if port_open("127.0.0.1", 5432):
        problem = _probe(LOCAL_DSN)
        if problem is None:
            return Service("postgres", LOCAL_DSN)
        reasons.append(f"local server on 127.0.0.1:5432: {problem}")
    else:
        reasons.append("local server: nothing listens on 127.0.0.1:5432")
    try:
        return start_cluster(workdir)
    except InfraUnavailable as exc:
        reasons.append(f"throwaway cluster: {exc}")
    raise InfraUnavailable("; ".join(reasons))


async def create_database(admin_dsn: str, name: str) -> str:
    """Create an empty database `name` and return its DSN (same server and user).

    A database of that name left over from an earlier run is dropped first, so the
    result is always fresh: give each test or benchmark its own name.

    Raises:
        ValueError: `name` is not a plain lower-case identifier.
    """
    ident = _checked(name)
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {ident} WITH (FORCE)")
        await conn.execute(f"CREATE DATABASE {ident}")
    finally:
        await conn.close()
    return with_database(admin_dsn, name)


async def ensure_database(admin_dsn: str, name: str) -> str:
    """Create database `name` if it does not exist; return its DSN. Keeps what is there."""
    ident = _checked(name)
    conn = await asyncpg.connect(admin_dsn)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f"CREATE DATABASE {ident}")
    finally:
        await conn.close()
    return with_database(admin_dsn, name)


async def drop_database(admin_dsn: str, name: str) -> None:
    """Drop database `name` if it exists, disconnecting its sessions."""
    ident = _checked(name)
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {ident} WITH (FORCE)")
    finally:
        await conn.close()


async def drop_roles(admin_dsn: str, roles: list[str]) -> None:
    """Drop login roles (if they exist) that own nothing any more."""
    conn = await asyncpg.connect(admin_dsn)
    try:
        for role in roles:
            await conn.execute(f"DROP ROLE IF EXISTS {_checked(role)}")
    finally:
        await conn.close()


@contextlib.contextmanager
def scratch_database(server: Service, prefix: str) -> Iterator[str]:
    """A fresh, uniquely named database on `server` for the block; dropped after it."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    dsn = run_apart(create_database(server.address, name))
    try:
        yield dsn
    finally:
        run_apart(drop_database(server.address, name))


def with_database(dsn: str, name: str) -> str:
    """The same DSN pointing at another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{name}"))


def _checked(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"not a plain database name: {name!r}")
    return f'"{name}"'


def _probe(dsn: str) -> str | None:
    """Why `dsn` does not take a superuser session, or None when it does."""

    async def check() -> str | None:
        try:
            conn = await asyncpg.connect(dsn, timeout=3)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            return f"cannot connect as postgres: {exc}"
        try:
            superuser = await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = user")
        finally:
            await conn.close()
        return None if superuser else "the postgres role is not a superuser"

    return run_apart(check())


def _start_container() -> Service:
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:  # testcontainers before the community split
        from testcontainers.postgres import PostgresContainer

    container = PostgresContainer(POSTGRES_IMAGE, driver=None)
    container.start()
    try:
        dsn = container.get_connection_url()
    except BaseException:
        container.stop()
        raise
    return Service("postgres", dsn, stop_hook=container.stop)


def _binaries() -> Path:
    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True):
        path = Path(bindir)
        if (path / "initdb").exists() and (path / "postgres").exists():
            return path
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return Path(found).parent
    raise InfraUnavailable("no initdb/postgres under /usr/lib/postgresql/*/bin or on PATH")


def _version(bindir: str) -> int:
    digits = Path(bindir).parent.name
    return int(digits) if digits.isdigit() else 0


def start_cluster(workdir: Path) -> Service:
    """Make a throwaway cluster with `initdb` and run it until `stop()`.

    Trust authentication, superuser `postgres`, loopback only, `fsync=on`. When
    this process is root the cluster lives in a fresh directory owned by the
    `postgres` OS user (Postgres refuses to run as root), removed at `stop()`.

    Raises:
        InfraUnavailable: the binaries are missing, or initdb or the server failed.
    """
    bindir = _binaries()
    log = log_file(workdir, "postgres")
    as_user: pwd.struct_passwd | None = None
    if os.geteuid() == 0:
        try:
            as_user = pwd.getpwnam("postgres")
        except KeyError as exc:
            raise InfraUnavailable("running as root and there is no postgres OS user") from exc
        home = Path(tempfile.mkdtemp(prefix="assay-pg-"))
        os.chown(home, as_user.pw_uid, as_user.pw_gid)
        log.touch()
        os.chown(log, as_user.pw_uid, as_user.pw_gid)
    else:
        home = Path(tempfile.mkdtemp(prefix="pg-", dir=workdir))
    data = home / "data"
    uid = as_user.pw_uid if as_user else None
    gid = as_user.pw_gid if as_user else None
    groups: list[int] | None = [] if as_user else None
    with open(log, "ab") as out:
        made = subprocess.run(
            [str(bindir / "initdb"), "-A", "trust", "-U", "postgres", "-E", "UTF8", "-D", data],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
            user=uid,
            group=gid,
            extra_groups=groups,
        )
    if made.returncode != 0:
        shutil.rmtree(home, ignore_errors=True)
        raise InfraUnavailable(f"initdb exited with {made.returncode} (log: {log})")
    reason = ""
    for _ in range(3):  # the free port can be taken before the server binds it: try another
        port = free_port()
        try:
            process = _serve(bindir, data, home, port, log, as_user)
        except InfraUnavailable as exc:
            reason = str(exc)
            continue
        service = Service(
            "postgres",
            f"postgresql://postgres@127.0.0.1:{port}/postgres",
            process=process,
            details={"bindir": str(bindir), "data": str(data), "home": str(home), "log": str(log)},
        )

        def stop(service: Service = service) -> None:
            if service.process is not None:
                _fast_shutdown(service.process)
            shutil.rmtree(service.details["home"], ignore_errors=True)

        service.stop_hook = stop
        return service
    shutil.rmtree(home, ignore_errors=True)
    raise InfraUnavailable(reason)


def _serve(
    bindir: Path, data: Path, home: Path, port: int, log: Path, as_user: pwd.struct_passwd | None
) -> subprocess.Popen[bytes]:
    """Start the server on `data` and wait until it accepts connections."""
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [bindir / "postgres", "-D", data, "-p", str(port), "-k", home, *_SETTINGS],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            user=as_user.pw_uid if as_user else None,
            group=as_user.pw_gid if as_user else None,
            extra_groups=[] if as_user else None,
        )
    try:
        wait_for_port("127.0.0.1", port, _START_TIMEOUT_S, process)
        _wait_accepting(bindir, port, process)  # listening is not yet accepting
    except InfraUnavailable as exc:
        _fast_shutdown(process)
        raise InfraUnavailable(f"{exc} (log: {log})") from exc
    return process


@contextlib.contextmanager
def cluster_down(service: Service) -> Iterator[None]:
    """Shut a cluster made by `start_cluster` down (fast: clients are cut off) for the
    block, then start it again on the same port and data, as a server restart does."""
    if service.process is None or "data" not in service.details:
        raise InfraUnavailable("only a cluster this process started can be restarted")
    _fast_shutdown(service.process)
    try:
        yield
    finally:
        port = urlsplit(service.address).port
        assert port is not None
        as_user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        d = service.details
        service.process = _serve(
            Path(d["bindir"]), Path(d["data"]), Path(d["home"]), port, Path(d["log"]), as_user
        )


def _wait_accepting(bindir: Path, port: int, process: subprocess.Popen[bytes]) -> None:
    """Wait until the server accepts connections: it listens before recovery ends, and
    a connection then is refused with "the database system is starting up"."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise InfraUnavailable(f"postgres exited with {process.returncode} while starting")
        ready = subprocess.run(
            [bindir / "pg_isready", "-q", "-h", "127.0.0.1", "-p", str(port)], check=False
        )
        if ready.returncode == 0:
            return
        time.sleep(0.05)
    raise InfraUnavailable(f"postgres on port {port} did not accept connections in time")


def _fast_shutdown(process: subprocess.Popen[bytes]) -> None:
    """SIGINT is Postgres's fast shutdown: it does not wait for clients to leave."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
