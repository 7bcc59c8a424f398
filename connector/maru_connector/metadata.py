"""Typed messages between the scheduler half and the worker half.

The scheduler half sends one :class:`MaruConnectorMetadata` per step (vLLM
pickles it to every worker); the worker half answers with
:class:`MaruWorkerMetadata`, which vLLM aggregates over workers and hands back
through ``update_connector_output``. Keys are 16-byte chunk keys of the
request's namespace for each tensor-parallel rank; a worker picks its rank's
tuple, and derives layer keys itself in the layerwise format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class ChunkRun:
    """Consecutive chunks of one request and the vLLM blocks that hold them.

    ``keys_by_rank[r][i]`` is the chunk key of chunk ``i`` for TP rank ``r``;
    ``block_ids[i]`` are the ``chunk_tokens // block_size`` blocks of chunk
    ``i``, in token order.
    """

    req_id: str
    keys_by_rank: tuple[tuple[bytes, ...], ...]
    block_ids: tuple[tuple[int, ...], ...]

    def keys(self, tp_rank: int) -> tuple[bytes, ...]:
        return self.keys_by_rank[tp_rank]

    @property
    def num_chunks(self) -> int:
        return len(self.block_ids)

    def all_block_ids(self) -> list[int]:
        return [b for chunk in self.block_ids for b in chunk]


@dataclass(frozen=True)
class LoadSpec(ChunkRun):
    """Load these chunks into these blocks; ``is_async`` parks the request."""

    is_async: bool = False


@dataclass(frozen=True)
class StoreSpec(ChunkRun):
    """Store these freshly computed chunks from these blocks."""


@dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, one per step.

    ``preempted_req_ids`` and ``finished_req_ids``: requests whose blocks may
    be reused from this step on; before the forward (``handle_preemptions``)
    the worker finishes every copy that still touches blocks vLLM has freed.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)


@dataclass
class MaruWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler: requests whose load failed (now a miss for them)."""

    failed_load_req_ids: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "MaruWorkerMetadata":
        if not isinstance(other, MaruWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into MaruWorkerMetadata")
        return MaruWorkerMetadata(self.failed_load_req_ids | other.failed_load_req_ids)
