"""`assay up --replicas` / `make up REPLICAS=...`: processes per stage, parsed strictly."""

from __future__ import annotations

import pytest

from assay.devstack.deployment import (
    MAX_REPLICAS,
    ReplicasInvalid,
    parse_replicas,
    replica_names,
)


def test_counts_per_stage_by_spaces_or_commas() -> None:
    assert parse_replicas("execute=3 tournament=2") == {"execute": 3, "tournament": 2}
    assert parse_replicas("execute=3,verify=1") == {"execute": 3, "verify": 1}
    assert parse_replicas("") == {}


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("executor=2", "'executor=2' is not stage=count"),
        ("execute", "'execute' is not stage=count"),
        ("execute=0", "from 1 to"),
        ("execute=-1", "from 1 to"),
        ("execute=two", "from 1 to"),
        (f"execute={MAX_REPLICAS + 1}", "from 1 to"),
        ("execute=2 execute=3", "execute is given twice"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(text: str, names: str) -> None:
    with pytest.raises(ReplicasInvalid, match=names):
        parse_replicas(text)


def test_the_first_replica_is_named_for_its_stage() -> None:
    assert replica_names("execute", 3) == ["execute", "execute-2", "execute-3"]
    assert replica_names("verify", 1) == ["verify"]
