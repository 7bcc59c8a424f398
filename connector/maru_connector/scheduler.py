"""The scheduler half: lookups, load plans, store plans, parked requests.

Runs in vLLM's engine-core process, on the scheduling thread. It owns no
bytes: it decides which chunks a request loads (and into which blocks) and
which freshly computed chunks the workers store, and sends those decisions to
the worker half as :class:`MaruConnectorMetadata`. Its memory is bounded by
the number of live requests: per-request state is dropped in
``request_finished``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from maru_core.stats import ConnectorStats
from maru_core.storage_format import StorageFormat

from maru_connector.block_aliases import chunk_aliases, prompt_tail
from maru_connector.config import MaruConfig
from maru_connector.early_pins import PinHandoff
from maru_connector.formats import configured_format, strategy_for
from maru_connector.identity import (
    AdapterIdentities,
    AdapterUnreadable,
    RequestKeys,
    request_is_cacheable,
    request_keys,
)
from maru_connector.kv_events import StoreEventLedger, chunk_block_hashes, chunk_payloads
from maru_connector.log import get_logger
from maru_connector.lookup import LookupService, TailQuery
from maru_connector.metadata import (
    LoadSpec,
    MaruConnectorMetadata,
    MaruWorkerMetadata,
    StoreSpec,
)
from maru_connector.request_params import PARK, SYNC, requested_load_mode, requested_store
from maru_connector.transfer.plan import SKIP_BLOCK

if TYPE_CHECKING:
    from maru_core.keys import KeyNamespace
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)

# Steps whose stores may wait for their workers' report at once; vLLM reports
# every step, so only a broken report path ever reaches this.
_MAX_STEPS_AWAITING_VERDICT = 256


@dataclass(frozen=True)
class _AliasHit:
    """A lookup's block alias: chunk ``chunk`` of the prompt loads the first
    ``blocks`` blocks of the committed chunk ``target``."""

    chunk: int
    blocks: int
    target: bytes


@dataclass
class _RequestState:
    request: "Request"
    cacheable: bool = True  # False: something its KV depends on cannot be keyed
    load_mode: str | None = None  # the request's own ``maru_load`` (request_params.py); None: the engine's
    store: bool = True  # False: the request's own ``maru_store`` keeps its KV out of the pool
    keys: RequestKeys | None = None
    local_tokens: int = 0  # vLLM's own (block-aligned) hit at the last lookup
    hit_tokens: int = 0  # what the last lookup answered beyond local_tokens
    alias_hit: _AliasHit | None = None  # the last lookup's hit ends inside this chunk
    tail_stored: bool = False  # the prompt's tail (``block_aliases.py``) is in the pool or on its way
    stored_chunks: int = 0  # chunks [0, stored_chunks) are in the pool or on their way
    load_first_chunk: int | None = None  # where the last planned load began
    lookup_first_chunk: int | None = None  # where the lookup in flight began
    load_failed: bool = False  # a failed load is a miss for the rest of the request
    park: bool = False  # what the last lookup told vLLM: load while parked
    parked: bool = False
    store_sent: bool = False


class MaruSchedulerHalf:
    """Scheduler-side logic of :class:`~maru_connector.MaruKVConnector`.

    Args:
        cfg: the parsed knobs.
        namespaces: one key namespace per TP rank (index = rank).
        block_size: vLLM's KV block size (divides ``cfg.maru_kv_chunk_tokens``).
        lookup: the time-bounded ``match_prefix`` service.
        num_layers: the model's layer count; a chunk counts as stored only
            when every object of it is (one per layer in the layerwise format).
        stats: where lookups, hit tokens, parked requests and recomputed
            tokens are counted (in memory when None).
        handoff: the engine's early-pin handoff in this process; while a worker
            half is attached to it, lookups pin what they match and the load
            plans hand those pins over (``early_pins.py``).
        kv_events: vLLM publishes KV events: the stores committed on every
            rank and the stored chunks lookups find gone are published
            through :meth:`take_events` (``kv_events.py``).
        partial_chunk_loads: the workers' transfer engines load a chunk from
            one of its blocks on (``TransferBackend.partial_chunk_loads``):
            a local hit that ends inside a chunk is then looked up from that
            chunk; else such a hit asks the pool for nothing.
        block_alias_loads: the workers' transfer engines load a chunk's
            first blocks only (``TransferBackend.block_alias_loads``): with
            ``maru_block_aliases``, a lookup that stops before the end of the
            prompt then goes on to the block aliases of the chunk it missed.
    """

    def __init__(
        self,
        cfg: MaruConfig,
        namespaces: tuple["KeyNamespace", ...],
        block_size: int,
        lookup: LookupService,
        num_layers: int | None = 1,
        stats: ConnectorStats | None = None,
        handoff: PinHandoff | None = None,
        kv_events: bool = False,
        partial_chunk_loads: bool = False,
        block_alias_loads: bool = False,
    ) -> None:
        if cfg.maru_kv_chunk_tokens % block_size:
            raise ValueError(
                f"chunk of {cfg.maru_kv_chunk_tokens} tokens is not a multiple of "
                f"block size {block_size}"
            )
        self.cfg = cfg
        self._namespaces = namespaces
        self._chunk = cfg.maru_kv_chunk_tokens
        self._block_size = block_size
        self._partial_chunk_loads = partial_chunk_loads
        # Aliases of stored chunks are registered whenever on; looked up (one
        # rank only: the load's keys are the lookup's) where the engines load them.
        self._store_aliases = cfg.maru_block_aliases
        self._load_aliases = cfg.maru_block_aliases and block_alias_loads and len(namespaces) == 1
        # Prompt tails take a chunk's room for a few blocks: stored only where
        # engines of this kind (one namespace: the same backend) load them.
        self._store_tails = self._load_aliases and cfg.maru_kv_chunk_tokens > block_size
        self._blocks_per_chunk = cfg.maru_kv_chunk_tokens // block_size
        self._lookup = lookup
        self._storage = strategy_for(configured_format(cfg))
        self._layers = tuple(range(num_layers or 0))  # None: not known (only a chunkwise cache does without)
        self._objects_per_chunk = self._storage.objects_per_chunk(len(self._layers))
        if self._objects_per_chunk < 1:
            raise ValueError(f"the {self._storage.storage.value} format needs the model's layer count "
                             f"(num_layers), not {num_layers!r}")
        self._handoff = handoff
        self.stats = stats if stats is not None else ConnectorStats(role="scheduler")
        self._reqs: dict[str, _RequestState] = {}
        self._pending_loads: list[LoadSpec] = []
        self._step = 0
        # Steps whose stores were sent and whose verdict is not known yet, and
        # verdicts (step -> commit?) not yet sent to the workers.
        self._awaiting_verdict: set[int] = set()
        self._verdicts: dict[int, bool] = {}
        self._held: set[str] = set()  # finished requests whose blocks vLLM keeps for stores
        self._adapters = AdapterIdentities()  # LoRA adapters named by their files
        self._events = StoreEventLedger(len(namespaces)) if kv_events else None

    # ---- lookup -----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that the pool holds.

        Answers ``(None, False)`` while the lookup is in flight, ``(0, False)``
        on a miss or after a failed load of this request; otherwise ``(n,
        park)`` (see :meth:`_should_park`). At least one prompt token is
        always left to compute.

        vLLM's own hit (``num_computed_tokens``, whole blocks) may end inside
        a chunk: the lookup then starts at that chunk, and the load writes
        only its blocks from the hit on (``_plan_load``), where the workers'
        engines can (``partial_chunk_loads``; else such a hit gets nothing).
        """
        state = self._state(request)
        if state.load_failed or not state.cacheable or not self._may_load_from(num_computed_tokens):
            return 0, False
        keys = self._keys(state)
        first = num_computed_tokens // self._chunk
        tail = self._tail_query(keys, first, num_computed_tokens)
        if keys.num_chunks <= first and tail is None:
            return 0, False  # no whole chunk to ask for, nor any block past vLLM's own hit
        # A lookup still in flight answers for the chunks it was asked about,
        # even when vLLM's own hit has grown since.
        base = state.lookup_first_chunk if state.lookup_first_chunk is not None else first
        matched = self._lookup.match(request.request_id, self._lookup_keys(keys, first),
                                     pin_group=self._early_pin_group(),
                                     tail=tail)
        if matched is None:
            state.lookup_first_chunk = base
            return None, False
        state.lookup_first_chunk = None
        matched //= self._objects_per_chunk
        self._note_gone(request, keys, base + matched)
        self.stats.record_lookup()
        hit_end = (base + matched) * self._chunk
        state.alias_hit = self._alias_hit(request.request_id, base + matched)
        if state.alias_hit is not None:
            hit_end = state.alias_hit.chunk * self._chunk + state.alias_hit.blocks * self._block_size
        hit_end = min(hit_end, request.num_tokens - 1)
        ext = max(0, hit_end - num_computed_tokens)
        state.local_tokens, state.hit_tokens = num_computed_tokens, ext
        state.park = bool(ext) and self._should_park(state)
        if ext:
            self._start_head(request.request_id, first, -(-hit_end // self._chunk))
        return ext, state.park

    def _tail_query(self, keys: RequestKeys, first: int, num_computed_tokens: int) -> TailQuery | None:
        """What a lookup from chunk ``first`` asks beyond its whole chunks: the
        block aliases of the chunk it misses that reach past vLLM's own hit."""
        if not self._load_aliases or keys.namespaces is None:
            return None
        if keys.num_chunks <= first and keys.alias_blocks(first) * self._block_size <= (
                num_computed_tokens - first * self._chunk):
            return None  # the prompt's last chunk has no whole block beyond vLLM's own hit

        def candidates(chunks_matched: int) -> list[tuple[int, bytes]]:  # on the lookup thread
            chunk = first + chunks_matched
            most = keys.alias_blocks(chunk)
            held = max(0, num_computed_tokens - chunk * self._chunk) // self._block_size
            if most <= held:
                return []
            aliases = keys.block_aliases(0, chunk, most)
            return [(j, aliases[j - 1]) for j in range(most, held, -1)]

        layers = self._layers if self._storage.storage is StorageFormat.LAYERWISE else None
        return TailQuery(self._objects_per_chunk, layers, candidates)

    def _alias_hit(self, req_id: str, chunk: int) -> _AliasHit | None:
        """The block alias the lookup found for chunk ``chunk``, the first it missed."""
        tail = self._lookup.take_tail(req_id)
        if tail is None:
            return None
        return _AliasHit(chunk, tail.blocks, tail.target)

    def _may_load_from(self, num_computed_tokens: int) -> bool:
        """Whether a load may begin at token ``num_computed_tokens``: on a
        chunk boundary, or on a block boundary inside a chunk where the
        engines load part of a chunk."""
        if num_computed_tokens % self._chunk == 0:
            return True
        return self._partial_chunk_loads and num_computed_tokens % self._block_size == 0

    def _note_gone(self, request: "Request", keys: RequestKeys, chunk: int) -> None:
        """A lookup answered that ``chunk`` is the first chunk missing: if the
        index was reached and this engine published it as stored, it is gone."""
        if self._events is None or chunk >= keys.num_chunks or self._lookup.index_down:
            return
        hashes = chunk_block_hashes(request, chunk, self._blocks_per_chunk)
        self._events.chunk_gone(keys.by_rank[0][chunk], hashes)

    def _start_head(self, req_id: str, first: int, end: int) -> None:
        """With an early pin, start the load's first copies now: vLLM
        allocates blocks and prepares the step before the worker sees the
        load (chunks ``first`` to ``end``, as ``_plan_load`` will plan them)."""
        if self._handoff is None:
            return
        pin = self._lookup.early_pin(req_id)
        if pin is not None:
            self._handoff.start_head(pin, end - first)

    def _early_pin_group(self) -> int:
        """Objects per chunk when lookups should pin early, else 0: only for
        one worker half in this process (one rank; its keys are the lookup's)."""
        if self._handoff is None or len(self._namespaces) != 1 or not self._handoff.worker_attached:
            return 0
        return self._objects_per_chunk

    def _should_park(self, state: _RequestState) -> bool:
        """Whether a hit loads while its request waits parked (vLLM's
        waiting-for-remote-KV state) or in the step that computes it.

        Parking lets the engine run other requests while the KV loads, and
        costs the hit one more engine step. With no other request live that
        step buys nothing: the load then runs in the step that computes the
        request, as a sync load does (with overlap, beside its forward).
        ``maru_park_lone_hits`` parks every hit. A request's own ``maru_load``
        comes first.
        """
        if state.load_mode is not None:
            return state.load_mode == PARK
        if not self.cfg.maru_async_load:
            return False
        if self.cfg.maru_park_lone_hits:
            return True
        return len(self._reqs) > 1  # the request itself is tracked since its lookup

    def may_load_async(self, request: "Request") -> bool:
        """Whether a lookup of ``request`` may answer with a parked load.

        vLLM (0.34 on) asks whenever the request enters its waiting queues,
        to count it against ``--max-num-inflight-kv-loads`` and let it start
        loading while the running batch is full; without a yes the parked
        load sits in the plain queue and can hold the loads behind it. Cheap
        and free of side effects: no lookup, no state for a new request.
        """
        state = self._reqs.get(request.request_id)
        if state is not None:
            if state.load_failed or not state.cacheable:
                return False
            mode = state.load_mode
        else:
            mode = requested_load_mode(request.kv_transfer_params, self.cfg.maru_async_load,
                                       self.cfg.maru_overlap_load_with_compute)
        return mode == PARK if mode is not None else self.cfg.maru_async_load

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        """Plan the load of ``num_external_tokens`` into the allocated blocks,
        handing the lookup's early pin (if any) to the worker with the plan."""
        early = self._lookup.take_early_pin(request.request_id)
        spec = self._plan_load(request, blocks, num_external_tokens)
        if early is not None:
            if spec is not None and self._handoff is not None:
                spec = replace(spec, early_pin=self._handoff.offer(early))
            else:
                early.release()
        if spec is not None:
            self._pending_loads.append(spec)

    def _plan_load(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> LoadSpec | None:
        if num_external_tokens <= 0:
            return None
        state = self._state(request)
        local = state.local_tokens
        first = local // self._chunk
        end = -(-(local + num_external_tokens) // self._chunk)
        block_ids = blocks.get_block_ids()[0]
        alias = state.alias_hit if state.alias_hit is not None and state.alias_hit.chunk == end - 1 else None
        whole_end = min(end - 1 if alias else end, len(block_ids) // self._blocks_per_chunk)
        keys_by_rank = self._keys(state).slice(first, whole_end)
        chunk_blocks = self._chunk_blocks(block_ids, first, whole_end)
        if alias is not None and whole_end == alias.chunk:  # its first blocks, from the chunk it names
            start = alias.chunk * self._blocks_per_chunk
            written = tuple(block_ids[start : start + alias.blocks])
            chunk_blocks += (written + (SKIP_BLOCK,) * (self._blocks_per_chunk - len(written)),)
            keys_by_rank = ((*keys_by_rank[0], alias.target),)
            end = whole_end + 1
        else:
            end = whole_end
        if end <= first:
            return None
        held = (local - first * self._chunk) // self._block_size  # vLLM's own blocks of chunk ``first``
        if held:  # loaded and verified with their object, not written
            chunk_blocks = ((SKIP_BLOCK,) * held + chunk_blocks[0][held:], *chunk_blocks[1:])
        spec = LoadSpec(
            req_id=request.request_id,
            keys_by_rank=keys_by_rank,
            block_ids=chunk_blocks,
            is_async=state.park,
            wait_whole=state.load_mode == SYNC,
            new_tokens=max(0, request.num_tokens - local - num_external_tokens),
        )
        self.stats.record_hit_tokens(num_external_tokens)
        if spec.is_async:
            self.stats.record_parked_load()
        state.load_first_chunk = min(first, state.stored_chunks)
        state.stored_chunks = max(state.stored_chunks, whole_end)  # an aliased chunk is still ours to store
        state.parked = spec.is_async
        return spec

    # ---- per step ---------------------------------------------------------

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> MaruConnectorMetadata:
        """This step's loads, the stores of chunks this step completes, the
        verdicts on earlier steps' stores, and drains. vLLM calls it once at
        the end of every ``schedule()``: the lookups' per-pass wait starts over."""
        self._lookup.end_pass()
        self._step += 1
        meta = MaruConnectorMetadata(
            step=self._step,
            loads=self._pending_loads,
            store_verdicts=self._verdicts,
            preempted_req_ids=set(scheduler_output.preempted_req_ids or ()),
            finished_req_ids=set(scheduler_output.finished_req_ids),
            scheduled_req_ids=frozenset(scheduler_output.num_scheduled_tokens),
            held_req_ids=self._held,
        )
        self._pending_loads, self._verdicts, self._held = [], {}, set()
        block_state = scheduler_output.kv_connector_block_state
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            spec = self._plan_store(req_id, num_tokens, block_state)
            if spec is not None:
                meta.stores.append(spec)
        if meta.stores:
            self._awaiting_verdict.add(self._step)
            if len(self._awaiting_verdict) > _MAX_STEPS_AWAITING_VERDICT:
                # Reports stopped coming back: judge the oldest step now.
                self._decide(min(self._awaiting_verdict), commit=False)
        self.stats.set_parked_requests(sum(s.parked for s in self._reqs.values()))
        return meta

    def has_pending_push_work(self) -> bool:
        """True while stores wait for a verdict the workers have not been sent:
        vLLM keeps stepping until they have it."""
        unsettled = self._events is not None and self._events.unsettled  # stores whose events are due
        return bool(self._awaiting_verdict or self._verdicts or self._held or unsettled)

    def take_events(self) -> list["KVCacheEvent"]:
        """KV events since the last call (none unless vLLM publishes them)."""
        return self._events.take_events() if self._events is not None else []

    def _plan_store(self, req_id: str, num_tokens: int, block_state: Any) -> StoreSpec | None:
        """The chunks this step completes, with their block aliases, and once
        the prompt is computed its tail (``block_aliases.py``) as one more."""
        state = self._reqs.get(req_id)
        if state is None or state.parked or not state.cacheable or not state.store or block_state is None:
            return None
        request = state.request
        prompt_len = len(request.prompt_token_ids or ())
        computed_after = min(request.num_computed_tokens + num_tokens, prompt_len)
        full = computed_after // self._chunk
        tail_due = self._store_tails and not state.tail_stored and computed_after == prompt_len
        if full <= state.stored_chunks and not tail_due:
            return None
        groups = block_state.get_block_ids(req_id)
        if not groups:
            return None
        block_ids = groups[0]
        start = state.stored_chunks
        full = max(start, min(full, len(block_ids) // self._blocks_per_chunk))
        keys = self._keys(state)
        tail = prompt_tail(keys, block_ids, self._blocks_per_chunk) if tail_due and keys.namespaces else None
        if full == start and tail is None:
            return None
        state.stored_chunks = full
        state.store_sent = True
        if self._events is not None:  # the tail is not a chunk of the prompt: never published
            self._events.plan(self._step, req_id, chunk_payloads(
                request, start, keys.by_rank[0][start:full], self._chunk, self._chunk // self._blocks_per_chunk))
        spec = StoreSpec(
            req_id=req_id,
            keys_by_rank=keys.slice(start, full),
            block_ids=self._chunk_blocks(block_ids, start, full),
            step=self._step,
            aliases_by_rank=self._store_aliases_of(keys, start, full),
        )
        if tail is None:
            return spec
        state.tail_stored = True
        return replace(
            spec,
            keys_by_rank=tuple((*k, t) for k, t in zip(spec.keys_by_rank, tail.keys_by_rank)),
            block_ids=(*spec.block_ids, tail.block_ids),
            aliases_by_rank=tuple((*a, t) for a, t in zip(spec.aliases_by_rank, tail.aliases_by_rank)),
        )

    def _store_aliases_of(self, keys: RequestKeys, start: int, end: int) -> tuple[tuple[bytes, ...], ...]:
        """Per rank, per chunk ``start`` to ``end``: its block aliases packed end
        to end, which the workers register once the chunk is committed."""
        if not self._store_aliases or keys.namespaces is None or self._blocks_per_chunk == 1:
            return ()
        return chunk_aliases(keys, start, end, self._blocks_per_chunk)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Turn failed loads into misses, decide the step's stores, unpark
        requests whose load ended.

        The metadata is every rank's report on one step, aggregated by vLLM:
        the step's stores are committed only when no rank's forward used a
        failed load. A step whose report never came is judged with the next
        report: its stores are dropped (any doubt means no store).
        """
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, MaruWorkerMetadata):
            for req_id in meta.failed_load_req_ids:
                self._fail_request(req_id)
            self._decide(meta.step, commit=not meta.tainted)
            if self._events is not None:
                self._events.settle(meta.settled_stores)
                self._events.expire(self._step)
        for req_id in connector_output.finished_recving or ():
            state = self._reqs.get(req_id)
            if state is not None:
                state.parked = False

    def _fail_request(self, req_id: str) -> None:
        state = self._reqs.get(req_id)
        if state is None or state.load_failed:
            return
        state.load_failed = True
        self.stats.record_recomputed_tokens(state.hit_tokens)
        # vLLM recomputes from the failed blocks on: those chunks may be stored again.
        if state.load_first_chunk is not None:
            state.stored_chunks = min(state.stored_chunks, state.load_first_chunk)
            state.tail_stored = False

    def _decide(self, step: int, commit: bool) -> None:
        for waiting in sorted(self._awaiting_verdict):
            if waiting > step:
                break
            self._awaiting_verdict.discard(waiting)
            ok = commit and waiting == step
            if not ok:
                logger.warning("stores of step %d dropped: %s", waiting,
                               "a load its forward used failed" if waiting == step
                               else "no report on that step came back")
            self._verdicts[waiting] = ok

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; keep its blocks while async stores read them.

        A request that ends while parked returns ``False``: vLLM itself holds
        its blocks until the worker reports the load finished.
        """
        state = self._reqs.pop(request.request_id, None)
        self._lookup.forget(request.request_id)
        if state is None or state.parked:
            return False, None
        hold = self.cfg.maru_async_store and state.store_sent
        if hold:
            self._held.add(request.request_id)
        return hold, None

    def shutdown(self) -> None:
        self._lookup.close()
        self.stats.close()

    # ---- helpers ----------------------------------------------------------

    @property
    def num_tracked_requests(self) -> int:
        return len(self._reqs)

    def _state(self, request: "Request") -> _RequestState:
        state = self._reqs.get(request.request_id)
        if state is None:
            cacheable, why = request_is_cacheable(request)
            keys = None
            if cacheable:  # keys now: a request whose LoRA adapter cannot be named has none
                try:
                    keys = request_keys(self._namespaces, request, self._adapters)
                except AdapterUnreadable as exc:
                    cacheable, why = False, f"its LoRA adapter cannot be named by its files ({exc})"
                self._stop_storing_reloaded_adapters()
            if not cacheable:
                logger.info("request %s is neither looked up nor stored: %s", request.request_id, why)
            mode = requested_load_mode(request.kv_transfer_params, self.cfg.maru_async_load,
                                       self.cfg.maru_overlap_load_with_compute)
            state = self._reqs[request.request_id] = _RequestState(
                request, cacheable=cacheable, load_mode=mode, store=requested_store(request.kv_transfer_params),
                keys=keys)
        return state

    def _stop_storing_reloaded_adapters(self) -> None:
        """Requests of an adapter reloaded in place with other weights compute
        the rest of their KV with the new weights, under keys of the old: they
        store nothing more."""
        reloaded = self._adapters.take_reloaded()
        if not reloaded:
            return
        for state in self._reqs.values():
            lora = state.request.lora_request
            if lora is not None and lora.lora_int_id in reloaded and state.store:
                logger.info("request %s stores nothing more: its LoRA adapter was reloaded with other "
                            "weights", state.request.request_id)
                state.store = False

    def _keys(self, state: _RequestState) -> RequestKeys:
        """The keys taken when the request was first seen (only cacheable ones have any)."""
        assert state.keys is not None, "a request that is not cacheable has no keys"
        return state.keys

    def _lookup_keys(self, keys: RequestKeys, first: int) -> list[bytes]:
        """Keys to match from chunk ``first``, packed end to end per TP rank:
        the keys of every chunk's objects, chunk-major (the storage format's)."""
        lists = keys.slice(first, keys.num_chunks)
        return [self._storage.object_keys(k, self._layers) for k in lists]

    def _chunk_blocks(
        self, block_ids: list[int], first: int, end: int
    ) -> tuple[tuple[int, ...], ...]:
        per = self._blocks_per_chunk
        return tuple(tuple(block_ids[c * per : (c + 1) * per]) for c in range(first, end))
