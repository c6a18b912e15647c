"""An S3 API for development and tests: from the environment, MinIO, or a moto server."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from assay.devstack.base import (
    InfraUnavailable,
    Service,
    docker_available,
    free_port,
    log_file,
    wait_for_port,
)

ENDPOINT_ENV = "ASSAY_TEST_S3_ENDPOINT"
ACCESS_KEY_ID_ENV = "ASSAY_TEST_S3_ACCESS_KEY_ID"
SECRET_ACCESS_KEY_ENV = "ASSAY_TEST_S3_SECRET_ACCESS_KEY"
REGION_ENV = "ASSAY_TEST_S3_REGION"

MINIO_IMAGE = "minio/minio:RELEASE.2025-04-22T22-12-26Z"
_MINIO_PORT = 9000
_MINIO_USER = "assay-minio"
_MINIO_PASSWORD = "assay-minio-secret"
_REGION = "us-east-1"
_START_TIMEOUT_S = 30.0


def resolve_s3(workdir: Path) -> Service:
    """Find or start an S3 API.

    In order: the endpoint in `ASSAY_TEST_S3_ENDPOINT` with the credentials in
    `ASSAY_TEST_S3_ACCESS_KEY_ID` / `ASSAY_TEST_S3_SECRET_ACCESS_KEY` (region from
    `ASSAY_TEST_S3_REGION`, default us-east-1), left running at `stop()`; a MinIO
    container when a Docker engine answers; a `moto` server started as a child
    process on a free loopback port. A started service ends at `stop()`.

    Args:
        workdir: where a started server writes its log.

    Returns:
        The service: `.address` is the endpoint URL, `.details` holds
        `access_key_id`, `secret_access_key` and `region`.

    Raises:
        InfraUnavailable: none of the three could be had; the message says why each failed.
    """
    endpoint = os.environ.get(ENDPOINT_ENV)
    if endpoint:
        return _from_environment(endpoint)
    reasons: list[str] = []
    if docker_available():
        try:
            return _start_minio()
        except Exception as exc:  # an image pull or a start failed: try the next way
            reasons.append(f"MinIO container: {exc}")
    else:
        reasons.append("MinIO container: no Docker engine answers")
    try:
        return _start_moto(workdir)
    except InfraUnavailable as exc:
        reasons.append(f"moto server: {exc}")
    raise InfraUnavailable("; ".join(reasons))


def _from_environment(endpoint: str) -> Service:
    key_id = os.environ.get(ACCESS_KEY_ID_ENV)
    secret = os.environ.get(SECRET_ACCESS_KEY_ENV)
    if not key_id or not secret:
        raise InfraUnavailable(
            f"{ENDPOINT_ENV} is set but {ACCESS_KEY_ID_ENV} / {SECRET_ACCESS_KEY_ENV} are not"
        )
    region = os.environ.get(REGION_ENV) or _REGION
    return Service("s3", endpoint, details=_details(key_id, secret, region))


def _start_minio() -> Service:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import HttpWaitStrategy

    container = (
        DockerContainer(MINIO_IMAGE)
        .with_exposed_ports(_MINIO_PORT)
        .with_env("MINIO_ROOT_USER", _MINIO_USER)
        .with_env("MINIO_ROOT_PASSWORD", _MINIO_PASSWORD)
        .with_command(f"server /data --address :{_MINIO_PORT}")
        .waiting_for(HttpWaitStrategy(_MINIO_PORT, "/minio/health/live"))
    )
    try:
        container.start()
        host = container.get_container_host_ip()
        port = container.get_exposed_port(_MINIO_PORT)
    except BaseException:
        with contextlib.suppress(Exception):  # it may never have been created
            container.stop()
        raise
    return Service(
        "s3",
        f"http://{host}:{port}",
        stop_hook=container.stop,
        details=_details(_MINIO_USER, _MINIO_PASSWORD, _REGION),
    )


def _start_moto(workdir: Path) -> Service:
    if importlib.util.find_spec("moto") is None:
        raise InfraUnavailable("moto is not installed (pip install 'moto[server]')")
    reason = ""
    for _ in range(3):  # the free port can be taken before the server binds it: try another
        port = free_port()
        log = log_file(workdir, "moto-s3")
        with open(log, "ab") as out:
            start = out.tell()
            process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        service = Service(
            "s3",
            f"http://127.0.0.1:{port}",
            process=process,
            # moto accepts any credentials; these only have to be present to sign requests.
            details=_details("assay-moto", "assay-moto-secret", _REGION),
        )
        try:
            wait_for_port("127.0.0.1", port, _START_TIMEOUT_S, process)
        except InfraUnavailable as exc:
            service.stop()
            reason = f"{exc} (log: {log})"
            with open(log, "rb") as written:
                written.seek(start)
                if b"Address already in use" not in written.read():
                    break  # another port would not help
            continue
        except BaseException:
            service.stop()
            raise
        return service
    raise InfraUnavailable(reason)


def _details(access_key_id: str, secret_access_key: str, region: str) -> dict[str, str]:
    return {
        "access_key_id": access_key_id,
        "secret_access_key": secret_access_key,
        "region": region,
    }
