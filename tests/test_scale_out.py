"""Scale-out: several processes of a stage share its topics' partitions (§9.4).

A deployment runs three replicas of execute and two of tournament — what
`make up REPLICAS="execute=3 tournament=2"` starts. Each stage's replicas join its
consumer group, and the group spreads the partitions across them; which replica
holds which partition is read from each replica's `/readyz`. One execute replica is then
killed (SIGKILL) while tasks are in flight: within the member timeout the group gives
its partitions to the two left, and every task still gets exactly one result (a
re-published result keeps its id). On two cores this proves correctness, not speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from assay.bus.topics import partition_count
from assay.devstack import Service
from assay.devstack.deployment import Deployment, deploy
from tests.pipeline import (
    DISTRIBUTED,
    TASKS,
    await_results,
    produce,
    results_by_task,
    set_up_tenant,
    task_records,
    wait_for,
)

pytestmark = [*DISTRIBUTED, pytest.mark.timeout(400)]

PARTITIONS = 6
CONTROL_PARTITIONS = 2
"""Not the default (1): two replicas can then share a control topic too."""
MEMBER_TIMEOUT_MS = 6_000
SHARE = 30
"""Tasks produced before the kill, and as many with it."""
EXECUTE_TOPICS = ("assay.runs", "assay.run-commands", "assay.results", "assay.tenants")


def held_by(d: Deployment, names: Iterable[str]) -> dict[str, set[str]] | None:
    """Which partitions (`topic/partition`) each named replica holds, from its `/readyz`;
    None while one of them has not joined its group. (Tansu answers DescribeGroups with
    no member assignments, so the replicas are asked, as an operator would.)"""
    out: dict[str, set[str]] = {}
    for name in names:
        _, doc = d.readiness(name)
        consumer = doc.get("checks", {}).get("consumer", {})
        if not consumer.get("joined"):
            return None
        out[name] = set(consumer.get("held", ()))
    return out


def spread_over(found: dict[str, set[str]] | None, topics: Iterable[str]) -> bool:
    """Each replica holds a partition, and together every partition of `topics` once."""
    if found is None or not all(found.values()):
        return False
    held = [tp for parts in found.values() for tp in parts]
    counts = {t: partition_count(t, PARTITIONS, CONTROL_PARTITIONS) for t in topics}
    wanted = {f"{t}/{p}" for t, n in counts.items() for p in range(n)}
    return len(held) == len(set(held)) and set(held) == wanted


async def until_spread(d: Deployment, names: Iterable[str], topics: Iterable[str]) -> float:
    """Wait until the partitions are spread over the named replicas; seconds it took."""
    start = time.monotonic()
    names, topics = tuple(names), tuple(topics)

    async def spread() -> bool:
        return spread_over(await asyncio.to_thread(held_by, d, names), topics)

    await wait_for(f"partitions spread over {', '.join(names)}", spread, timeout_s=60)
    return time.monotonic() - start


async def test_replicas_share_the_partitions_and_a_killed_one_hands_its_share_on(
    postgres: Service, s3: Service, tmp_path: Path
) -> None:
    d = await deploy(
        tmp_path / "deployment",
        postgres,
        s3,
        PARTITIONS,
        replicas={"execute": 3, "tournament": 2},
        extra_env={
            "ASSAY_KAFKA_MEMBER_TIMEOUT_MS": str(MEMBER_TIMEOUT_MS),
            "ASSAY_CONTROL_PARTITIONS": str(CONTROL_PARTITIONS),
        },
    )
    try:
        assert {"execute", "execute-2", "execute-3", "tournament", "tournament-2"} <= set(d.procs)
        await until_spread(d, ("execute", "execute-2", "execute-3"), EXECUTE_TOPICS)
        await until_spread(d, ("tournament", "tournament-2"), ("assay.verified", "assay.tenants"))
        tenant = await set_up_tenant(d, challenger=True)
        first, second = TASKS[:SHARE], TASKS[SHARE : 2 * SHARE]
        await produce(d.bootstrap, task_records(tenant, first))
        await await_results(d, {(tenant, t["idempotency_key"]) for t in first})

        await produce(d.bootstrap, task_records(tenant, second))
        d.kill("execute-2")  # mid-stream: some of the second half is on its partitions
        moved_s = await until_spread(d, ("execute", "execute-3"), EXECUTE_TOPICS)
        # the group waits out the silent member's session, then rebalances
        assert moved_s < 3 * MEMBER_TIMEOUT_MS / 1000

        expected = {(tenant, t["idempotency_key"]) for t in [*first, *second]}
        records = await await_results(d, expected)
        found = results_by_task(records, {tenant})
        assert set(found) == expected
        twice = {key: ids for key, ids in found.items() if len(ids) != 1}
        assert not twice, f"tasks with more than one result: {twice}"
    finally:
        d.stop()
