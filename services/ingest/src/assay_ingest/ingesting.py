"""What ingest's handlers share, handed to each unit of work as `uow.deps`."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from assay.engine.models import FREE, Prices
from assay.grading.judges import Judge
from assay.grading.ladder import LadderPolicy
from assay.grading.replay import ReplayPolicy
from assay.grading.strategies import GradingPolicy, GradingStrategy, builtin_strategies
from assay.kernel import TenantId, WorkflowId
from assay.runtime import UnitOfWork
from assay.runtime.admission import Admission


@dataclass
class Ingesting:
    """Ingest's shared dependencies and per-process state: one per stage, built by
    `create_stage`."""

    known_tools: frozenset[str]
    known_verifiers: frozenset[str]
    judge: Judge
    grading: GradingPolicy
    """A workflow's grading strategy must fit this capacity (§11.1)."""
    ladder: LadderPolicy
    """Its held-out fraction splits tasks (§12.5)."""
    replay: ReplayPolicy
    """Per-tenant ceilings on what shadow runs reserve (§12.4)."""
    admission: Admission
    """Capacity checks at registration and admission (§14.2); none without a declaration."""
    strategies: Mapping[str, GradingStrategy] = field(default_factory=builtin_strategies)
    """The registered grading strategies: a workflow naming another one is refused."""
    prices: Prices = FREE
    """The agent model's per-token prices: what a shadow run's worst case is priced at."""
    replay_locks: defaultdict[TenantId, asyncio.Lock] = field(
        default_factory=lambda: defaultdict(asyncio.Lock)
    )
    """Per tenant: held while a task reserves replay, until that reservation commits."""
    mix_locks: defaultdict[tuple[TenantId, WorkflowId], asyncio.Lock] = field(
        default_factory=lambda: defaultdict(asyncio.Lock)
    )
    """Per workflow: held while a task takes a slot of its task-mix window, until it commits."""


IngestUnitOfWork = UnitOfWork[Ingesting]
