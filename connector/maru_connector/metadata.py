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

from maru_connector.transfer.plan import SKIP_BLOCK


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
    """Load these chunks into these blocks; ``is_async`` parks the request.

    ``wait_whole``: ``start_load_kv`` returns only once this load landed,
    even on an engine that overlaps loads with the forward (the request
    asked for ``maru_load="sync"``). ``new_tokens``: the prompt tokens the
    request computes after the load (1 for a full hit); a forward that
    computes many beside it should not wait for all its copies to be queued.
    ``early_pin``: the token under which the lookup's pins of these chunks
    wait in this process's ``PinHandoff`` (0: none; the worker retrieves).

    A load that begins inside its first chunk (vLLM's own prefix cache
    holds that chunk's first blocks) names those blocks ``SKIP_BLOCK``: the
    worker verifies their bytes with their object but writes nothing there.
    So does one that ends inside its last chunk: that chunk's key is then
    the stored chunk a block alias named, whose first blocks it writes.
    """

    is_async: bool = False
    wait_whole: bool = False
    new_tokens: int = 0
    early_pin: int = 0

    def all_block_ids(self) -> list[int]:
        """The blocks this load writes (a failed load's, reported to vLLM)."""
        return [b for b in super().all_block_ids() if b != SKIP_BLOCK]


@dataclass(frozen=True)
class StoreSpec(ChunkRun):
    """Store these chunks, computed in scheduler step ``step``, from these blocks.

    ``aliases_by_rank[r][i]``: the block aliases of chunk ``i`` for TP rank
    ``r``, packed end to end (``maru_core.keys.block_alias_keys``), which the
    worker registers for each chunk the index committed (empty: none).
    """

    step: int = 0
    aliases_by_rank: tuple[tuple[bytes, ...], ...] = ()

    def aliases(self, tp_rank: int) -> tuple[bytes, ...]:
        return self.aliases_by_rank[tp_rank] if self.aliases_by_rank else ()


@dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, one per step.

    ``step``: the scheduler's step number; the stores of this step are
    copied now but committed only once the scheduler has sent this step's
    verdict in ``store_verdicts`` (step → commit?), decided from every rank's
    :class:`MaruWorkerMetadata` for the step: a step in which any rank's
    forward used a load that failed commits nothing.

    ``preempted_req_ids`` and ``finished_req_ids``: requests whose blocks may
    be reused from this step on; before the forward (``handle_preemptions``)
    the worker finishes every copy that still touches blocks vLLM has freed.

    ``scheduled_req_ids``: requests this step's forward computes (a load that
    failed after its request was released is reported in such a step, when
    vLLM can still roll the request back). ``held_req_ids``: finished requests
    whose blocks vLLM keeps until the worker reports them in
    ``finished_sending`` (``request_finished`` returned True for them).
    """

    step: int = 0
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    store_verdicts: dict[int, bool] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    scheduled_req_ids: frozenset[str] = frozenset()
    held_req_ids: set[str] = field(default_factory=set)


@dataclass
class MaruWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler, every step: what this step's loads did.

    ``failed_load_req_ids``: requests whose load failed (a miss for them from
    now on). ``tainted``: this step's forward computed on top of a load that
    failed, so none of the step's stores may be committed.
    ``settled_stores``: with KV events on, the store jobs whose outcome became
    final since the last report, each as (step, request id, indices of the
    chunks committed); every rank reports each of its jobs once, so the
    aggregate holds one entry per rank (``kv_events.py``).
    """

    step: int = 0
    failed_load_req_ids: set[str] = field(default_factory=set)
    tainted: bool = False
    settled_stores: tuple[tuple[int, str, tuple[int, ...]], ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "MaruWorkerMetadata":
        if not isinstance(other, MaruWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into MaruWorkerMetadata")
        if other.step != self.step:
            raise ValueError(f"workers report different steps ({self.step} and {other.step})")
        return MaruWorkerMetadata(
            self.step,
            self.failed_load_req_ids | other.failed_load_req_ids,
            self.tainted or other.tainted,
            self.settled_stores + other.settled_stores,
        )
