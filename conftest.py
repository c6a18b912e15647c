"""Infrastructure fixtures shared by every test directory.

Each resolves its service in order: an address from the environment, a
testcontainers container when a Docker engine answers, or a local process it
starts itself (`assay.devstack`). In CI (`CI=true`) a service that cannot be
had fails the test run; elsewhere the tests that need it are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from assay.devstack import InfraUnavailable, Service

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _unavailable(what: str, exc: Exception) -> None:
    message = f"{what} is not available here: {exc}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def infra_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where locally started services keep their files and logs."""
    return tmp_path_factory.mktemp("infra")


def _service(what: str, resolve: Callable[[Path], Service], workdir: Path) -> Iterator[Service]:
    try:
        service = resolve(workdir)
    except InfraUnavailable as exc:
        _unavailable(what, exc)
        raise
    yield service
    service.stop()


@pytest.fixture(scope="session")
def postgres(infra_dir: Path) -> Iterator[Service]:
    """A Postgres server (its superuser DSN in `.address`)."""
    from assay.devstack.postgres import resolve_postgres

    yield from _service("Postgres", resolve_postgres, infra_dir)


@pytest.fixture(scope="session")
def kafka(infra_dir: Path) -> Iterator[Service]:
    """A Kafka-protocol broker (its bootstrap address in `.address`)."""
    from assay.devstack.kafka import resolve_kafka

    yield from _service("a Kafka-protocol broker", resolve_kafka, infra_dir)


@pytest.fixture(scope="session")
def s3(infra_dir: Path) -> Iterator[Service]:
    """An S3 API (its endpoint URL in `.address`; credentials in `.details`)."""
    from assay.devstack.s3 import resolve_s3

    yield from _service("an S3 API", resolve_s3, infra_dir)
