"""What the operator's handlers share (built once by the composition root,
``cli``), in a module of its own so that the handlers and the upkeep they
call both use it without importing each other."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from .k8s import KubeApi, LedgerStore
from .metrics import OperatorMetrics
from .models import DEFAULT_IMAGE
from .results import ReconcileResult
from .scope import Scope
from .usage import UsageReader


@dataclasses.dataclass(frozen=True)
class Written:
    """The status this process last wrote for a cache, and what it was computed from."""

    generation: int
    result: ReconcileResult  # the reconcile result it came from
    status: dict[str, Any]
    available: bool  # whether the index Deployment was available


@dataclasses.dataclass
class OperatorContext:
    """Everything the handlers share; built once by the composition root (`cli`)."""

    api: KubeApi
    ledger: LedgerStore
    metrics: OperatorMetrics
    resync_seconds: float = 5.0
    full_resync_seconds: float = 60.0  # a cache that is not Ready gets its children checked this often
    last_full: dict[str, float] = dataclasses.field(default_factory=dict)
    written: dict[str, Written] = dataclasses.field(default_factory=dict)
    generations: dict[str, int] = dataclasses.field(default_factory=dict)  # newest generation reconciled
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    native_mode: str = "auto"  # native sidecars: auto (from the API server's version), always, never
    native_sidecars: bool = False  # what `native_mode` resolved to at start
    usage_reader: UsageReader | None = None  # None: status.used is not written
    usage_seconds: float = 30.0
    default_image: str = DEFAULT_IMAGE  # what index and sidecar run where a cache names no image
    last_usage: dict[str, float] = dataclasses.field(default_factory=dict)
    stale_reported: set[str] = dataclasses.field(default_factory=set)  # "pod uid:reason:placement" with an Event
    scope: Scope = Scope()  # the namespaces served (`--watch-namespace`); empty: cluster-wide

    def lock(self, uid: str) -> asyncio.Lock:
        return self.locks.setdefault(uid, asyncio.Lock())

    def forget(self, uid: str) -> None:
        """Drop what is kept about a deleted cache."""
        for table in (self.locks, self.last_full, self.written, self.generations, self.last_usage):
            table.pop(uid, None)
