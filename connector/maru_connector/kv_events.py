"""KV events for routers: the chunks this engine stored into and found gone from the pool.

With vLLM's ``kv_events_config`` enabled, vLLM publishes the events a
connector's scheduler side yields from ``take_events`` beside its own prefix
cache's, through its publisher (ZMQ). A cache-aware router joins them on
vLLM's block hashes, so the events name each chunk by the hashes of its vLLM
blocks, exactly as vLLM's own ``BlockStored`` events do, with ``medium``
``"CPU"`` (vLLM's name for host memory; the pool is host or CXL memory).

Who knows what:

- A store is known to have happened only when the index committed it, on
  every tensor-parallel rank: each worker reports each of its store jobs once
  it is settled (committed, aborted, refused or cancelled) with the chunks it
  committed (:class:`SettledStore`, in ``MaruWorkerMetadata``). The scheduler
  half planned the store and snapshotted the chunks' hashes and tokens then
  (:func:`chunk_payloads`); :class:`StoreEventLedger` publishes a chunk's
  ``BlockStored`` once every rank settled the job and all of them committed it.
- The index evicts without telling its clients. A lookup of this engine that
  answers (the index was reached) with a shorter prefix than a chunk this
  engine published as stored proves that chunk is gone: the ledger then
  publishes its ``BlockRemoved``. Evictions nobody looks up again are never
  published.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maru_connector.log import get_logger

if TYPE_CHECKING:  # vLLM's event types are imported where events are made: the
    # scheduler half also runs in the GPU benchmarks, where vLLM is not installed
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent
    from vllm.v1.request import Request

    from maru_connector.store import SettledStore

logger = get_logger(__name__)

#: The ``medium`` of every MaruCache event: the pool is host (or CXL) memory
#: (vLLM's ``MEDIUM_CPU``; a test holds the two equal).
MARU_MEDIUM = "CPU"

# Store plans whose settlement never came back are dropped this many steps
# later (a worker that died mid-step); only their events are lost.
_MAX_STEPS_UNSETTLED = 256
# Chunks remembered as published, for their removal; the oldest are forgotten.
_MAX_PUBLISHED_CHUNKS = 1 << 16


def kv_events_enabled(vllm_config: "VllmConfig") -> bool:
    """Whether vLLM publishes KV cache events (``kv_events_config``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


#: A block hash as vLLM's events carry it (``ExternalBlockHash``: 64-bit int or bytes).
EventBlockHash = int | bytes


@dataclass(frozen=True)
class ChunkPayload:
    """What a chunk's ``BlockStored`` says, taken while its request is alive.

    ``chunk_key``: the chunk's key on rank 0 (names the chunk for its removal);
    ``block_hashes``: its vLLM blocks' hashes as vLLM publishes them;
    ``parent_block_hash``: the hash of the block before it (None for the first).
    """

    chunk_key: bytes
    block_hashes: tuple[EventBlockHash, ...]
    parent_block_hash: EventBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None

    def stored(self) -> "BlockStored":
        from vllm.distributed.kv_events import BlockStored

        return BlockStored(
            block_hashes=list(self.block_hashes),
            parent_block_hash=self.parent_block_hash,
            token_ids=list(self.token_ids),
            block_size=self.block_size,
            lora_id=self.lora_id,
            medium=MARU_MEDIUM,
            lora_name=self.lora_name,
            extra_keys=list(self.extra_keys) if self.extra_keys is not None else None,
            group_idx=0,
        )


def chunk_block_hashes(request: "Request", chunk: int, blocks_per_chunk: int) -> list[EventBlockHash] | None:
    """The vLLM block hashes of chunk ``chunk`` of ``request``, as vLLM's events
    carry them; None when vLLM has not hashed all its blocks."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    first, end = chunk * blocks_per_chunk, (chunk + 1) * blocks_per_chunk
    hashes = request.block_hashes
    if len(hashes) < end:
        return None
    return [maybe_convert_block_hash(h) for h in hashes[first:end]]


def chunk_payloads(
    request: "Request", first: int, chunk_keys: Sequence[bytes], chunk_tokens: int, block_size: int
) -> list[ChunkPayload] | None:
    """The payloads of chunks ``first ..`` (one per key of ``chunk_keys``, rank 0's);
    None when vLLM has not hashed their blocks (nothing can name them)."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )

    per = chunk_tokens // block_size
    lora = request.lora_request
    payloads = []
    for i, key in enumerate(chunk_keys):
        chunk = first + i
        hashes = chunk_block_hashes(request, chunk, per)
        if hashes is None:
            return None
        start = chunk * chunk_tokens
        extra, mm_index = [], 0
        for b in range(per):  # as vLLM's own events: one entry per block
            keys, mm_index = generate_block_hash_extra_keys(
                request, start + b * block_size, start + (b + 1) * block_size, mm_index)
            extra.append(keys)
        event_extra = to_event_extra_keys(extra)
        parent = request.block_hashes[chunk * per - 1] if chunk else None
        payloads.append(ChunkPayload(
            chunk_key=key,
            block_hashes=tuple(hashes),
            parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
            token_ids=tuple(request.all_token_ids[start:start + chunk_tokens]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            extra_keys=tuple(event_extra) if event_extra is not None else None,
        ))  # fmt: skip
    return payloads


@dataclass
class _PlannedStore:
    payloads: list[ChunkPayload]
    reports: int = 0
    committed: set[int] | None = None  # chunks every rank that reported committed
    missing: bool = False  # a chunk's payload could not be taken: publish nothing


class StoreEventLedger:
    """The scheduler half's side of the events: store plans awaiting their
    settlement on every rank, chunks published as stored, events to publish.

    Args:
        num_ranks: tensor-parallel ranks; each settles every store job once.
    """

    def __init__(self, num_ranks: int) -> None:
        self._num_ranks = num_ranks
        self._planned: dict[tuple[int, str], _PlannedStore] = {}
        self._published: OrderedDict[bytes, None] = OrderedDict()  # rank-0 chunk keys, oldest first
        self._events: list["KVCacheEvent"] = []

    def plan(self, step: int, req_id: str, payloads: list[ChunkPayload] | None) -> None:
        """A store of ``req_id`` planned in ``step``; ``payloads``: one per chunk
        (None: the chunks cannot be named; the plan is tracked, nothing published)."""
        planned = _PlannedStore(payloads or [], missing=payloads is None)
        self._planned[(step, req_id)] = planned

    def settle(self, reports: Iterable[SettledStore]) -> None:
        """Ranks' settled store jobs; a chunk committed on every rank is published."""
        for step, req_id, committed in reports:
            planned = self._planned.get((step, req_id))
            if planned is None:
                continue  # dropped as too old, or planned before events were tracked
            chunks = set(committed)
            planned.committed = chunks if planned.committed is None else planned.committed & chunks
            planned.reports += 1
            if planned.reports >= self._num_ranks:
                del self._planned[(step, req_id)]
                if not planned.missing:
                    self._publish(planned)

    def expire(self, current_step: int) -> None:
        """Forget plans whose settlement is long overdue (their events are lost)."""
        for key in [k for k in self._planned if k[0] < current_step - _MAX_STEPS_UNSETTLED]:
            logger.warning("no settlement of the store of %s in step %d came back; "
                           "its KV events are not published", key[1], key[0])
            del self._planned[key]

    @property
    def unsettled(self) -> bool:
        """Store plans wait for a settlement from some rank."""
        return bool(self._planned)

    def chunk_gone(self, chunk_key: bytes, block_hashes: Sequence[EventBlockHash] | None) -> None:
        """A lookup that reached the index found this chunk missing: if this
        engine published it as stored, publish its removal."""
        if chunk_key not in self._published:
            return
        del self._published[chunk_key]
        if block_hashes:
            from vllm.distributed.kv_events import BlockRemoved

            self._events.append(BlockRemoved(block_hashes=list(block_hashes), medium=MARU_MEDIUM, group_idx=0))

    def take_events(self) -> list["KVCacheEvent"]:
        events, self._events = self._events, []
        return events

    def _publish(self, planned: _PlannedStore) -> None:
        assert planned.committed is not None, "settled at least once"
        for index in sorted(planned.committed):
            if not 0 <= index < len(planned.payloads):
                continue
            payload = planned.payloads[index]
            self._events.append(payload.stored())
            self._published[payload.chunk_key] = None
            self._published.move_to_end(payload.chunk_key)
            if len(self._published) > _MAX_PUBLISHED_CHUNKS:
                self._published.popitem(last=False)
