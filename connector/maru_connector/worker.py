"""The worker half: loads into and stores from vLLM's paged KV cache.

Runs in each vLLM worker process. It attaches the pool (directly or through
the sidecar), builds the transfer engine for the KV caches vLLM registers and
carries out what the scheduler half planned:

- synchronous loads in ``start_load_kv`` (before the forward): resolve (pin,
  check reply and slot headers), copy, unpin; with overlap the copies run
  while the forward waits per layer in ``wait_for_layer_load`` and are
  finished by the first of the step's report hooks or ``wait_for_save``,
  whichever vLLM calls first (with a speculative config it collects the
  report before ``wait_for_save``: a failure found only there would reach
  vLLM a step late, after it kept the token and the step's stores). The
  unpin, once the copies are done, runs on a thread of its own: its round
  trip to the index is no part of the step (early pins are given back on
  the lookup service's thread the same way);
- async loads on the :class:`~maru_connector.loader.AsyncLoader` thread;
- stores in ``wait_for_save`` through the :class:`~maru_connector.store.Storer`,
  committed only once the scheduler half's verdict on their step came back;
- sleep mode (vLLM 0.33 on): ``unregister_kv_caches`` finishes every copy
  that reads or writes the KV cache before vLLM releases it, and until
  ``restore_kv_caches`` no load or store touches it (loads fail: recompute).

Failed loads are reported through ``get_block_ids_with_load_errors`` (and to
the scheduler half as a miss for that request) in the step they are found,
except a load that fails after its request was released: that one is reported
in the first step whose forward computes the request, the only step in which
vLLM can still roll the request back. A step whose forward used a failed load
is reported ``tainted``: the scheduler then drops every store of that step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from maru_core.stats import ConnectorStats

from maru_connector.config import MaruConfig, MaruConfigError
from maru_connector.early_pins import EarlyPin, PinHandoff
from maru_connector.formats import configured_format
from maru_connector.loader import AsyncLoader, wait_done
from maru_connector.log import get_logger
from maru_connector.metadata import LoadSpec, MaruConnectorMetadata, MaruWorkerMetadata
from maru_connector.resolve import (
    LoadFailure,
    PinnedLoad,
    copy_failure_reason,
    head_sources,
    release_pins,
    resolve_load,
)
from maru_connector.stats import open_stats
from maru_connector.store import Storer
from maru_connector.transfer.backend import Transfer

if TYPE_CHECKING:
    import torch
    from maru_core.index.client import IndexClient
    from maru_core.pool import Pool

    from maru_connector.object_format import ObjectFormat
    from maru_connector.transfer.handles import LoadHandle

logger = get_logger(__name__)

# The longest a step that computed nothing waits for a parked load to be
# released or to fail; either ends the wait at once. Every step taken while
# parked runs vLLM's scheduling in Python, taking the GIL and a core from the
# loader and the copies, and a release that lands between steps waits for the
# next one, so the wait should end on the release, not before. The bound only
# limits how late a request that arrives while every request is parked is
# admitted (vLLM admits new requests between steps); a sync load would hold
# it for the whole load and forward.
_IDLE_STEP_MAX_WAIT_S = 0.05


@dataclass
class WorkerResources:
    """What a worker needs from the outside world, in one place; built at
    ``register_kv_caches`` (tests build their own around fakes)."""

    pool: Pool  # the attached pool: its buffer and slot headers
    engine: Transfer  # the transfer engine over the pool and vLLM's KV cache
    client_factory: Callable[[str], IndexClient]  # role name -> a new index client (own lease)
    # The worker's counters: in the sidecar's stats directory when the pool came from it.
    stats: ConnectorStats = field(default_factory=lambda: ConnectorStats(role="worker"))

    @property
    def fmt(self) -> ObjectFormat:
        """The object format of this worker's KV (the engine's)."""
        return self.engine.fmt

    def close(self) -> None:
        self.engine.close()
        self.pool.close()
        self.stats.close()


def copy_cpus_for(cfg: MaruConfig) -> frozenset[int] | None:
    """The cores for the CPU backend's copy threads, from ``maru_copy_cpus``
    and the OpenMP binding vLLM gave this process (``copy_cpus.py``)."""
    from maru_connector.transfer.copy_cpus import CopyCpusError, resolve_copy_cpus

    try:
        cpus = resolve_copy_cpus(cfg.maru_copy_cpus)
    except CopyCpusError as exc:
        raise MaruConfigError(str(exc)) from None
    if cpus:
        logger.info("CPU backend: copy threads on cores %s", sorted(cpus))
    return cpus


def open_resources(cfg: MaruConfig, kv_caches: dict[str, torch.Tensor], block_size: int) -> WorkerResources:
    """Attach the pool, detect the KV layout and build the transfer engine."""
    from maru_core.index.client import IndexClient

    from maru_connector.transfer import TransferEngine, create_engine

    fmt = TransferEngine.detect(kv_caches, cfg.maru_kv_chunk_tokens, configured_format(cfg), block_size)
    token = cfg.resolve_token()
    if cfg.maru_sidecar_socket is not None:
        from maru_core.handoff import fetch_pool

        handoff = fetch_pool(cfg.maru_sidecar_socket, token, cfg.maru_cache_name)
        try:
            index_url = cfg.resolve_index_url(handoff.index_url)
        except MaruConfigError:
            os.close(handoff.fd)
            raise
        pool = handoff.open_pool()
        stats = open_stats(cfg, "worker", handoff.stats_dir)
    else:
        from maru_core.pool import Pool

        assert cfg.maru_pool_path is not None, "MaruConfig requires one of the two"
        index_url = cfg.resolve_index_url()
        pool = Pool.attach(cfg.maru_pool_path)
        stats = open_stats(cfg, "worker")
    engine = create_engine(pool.buffer, kv_caches, fmt,
                           prefault=cfg.prefault_pool(pool.buffer.nbytes),
                           copy_cpus=copy_cpus_for(cfg),
                           copy_priority=cfg.maru_copy_priority)

    from maru_core.pool.pool_identity import PoolIdentity

    mapped = PoolIdentity.of_pool(pool)  # an index serving another region is refused (WrongPool)

    def client_factory(role: str) -> IndexClient:
        return IndexClient(
            index_url,
            token=token,
            client_name=f"maru-worker-{role}-{os.getpid()}",
            timeout_s=cfg.maru_load_timeout_s,
            pool=mapped,
        )

    return WorkerResources(pool, engine, client_factory, stats)


@dataclass
class _SyncLoad:
    spec: LoadSpec
    pinned: PinnedLoad
    handle: LoadHandle
    overlapped: bool  # the forward may start before it landed, waiting per layer


class MaruWorkerHalf:
    """Worker-side logic of :class:`~maru_connector.MaruKVConnector`.

    Args:
        cfg: the parsed knobs.
        tp_rank: this worker's tensor-parallel rank (picks its keys).
        block_size: vLLM's KV block size.
        resources_factory: builds the pool, engine and clients (tests inject).
        handoff: the engine's early-pin handoff in this process: the worker
            attaches to it and claims the pins its load plans name.
        report_settled_stores: vLLM publishes KV events: report each store's
            committed chunks to the scheduler half (``kv_events.py``).
    """

    def __init__(
        self,
        cfg: MaruConfig,
        tp_rank: int,
        block_size: int,
        resources_factory: Callable[..., WorkerResources] = open_resources,
        handoff: PinHandoff | None = None,
        report_settled_stores: bool = False,
    ) -> None:
        self.cfg = cfg
        self._handoff = handoff
        self._report_settled_stores = report_settled_stores
        self._tp_rank = tp_rank
        self._block_size = block_size
        self._resources_factory = resources_factory
        # The resources' counters from register_kv_caches on (nothing is recorded before).
        self.stats = ConnectorStats(role="worker")
        self._res: WorkerResources | None = None
        self._sync_client: IndexClient | None = None
        self._unpinner: ThreadPoolExecutor | None = None  # the sync loads' unpins
        self._loader: AsyncLoader | None = None
        self._storer: Storer | None = None
        self._sync_loads: list[_SyncLoad] = []
        self._error_blocks: set[int] = set()
        self._failed_req_ids: set[str] = set()
        self._tainted = False  # this step's forward used a load that failed
        self._asleep = False  # vLLM released the KV cache (sleep mode) until restore
        self._refused_async: set[str] = set()  # parked loads refused while asleep, to report

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        res = self._res = self._resources_factory(self.cfg, kv_caches, self._block_size)
        self.stats = res.stats
        self._layout = res.fmt.layout
        device_bytes = getattr(res.engine, "device_bytes", None)
        if device_bytes is not None:  # taken after vLLM sized its KV cache
            logger.info("MaruCache takes %d MiB of device memory beside the KV cache (staging)",
                        device_bytes() >> 20)
        self._verify_payload = self.cfg.verify_payload(res.engine.backend, res.fmt)
        if self.cfg.maru_async_load:
            release_after = (
                self.cfg.maru_overlap_release_after_layers
                if self.cfg.maru_overlap_load_with_compute
                else self._layout.num_layers
            )
            self._loader = AsyncLoader(
                lambda: res.client_factory("loader"),
                res.pool,
                res.engine,
                self._tp_rank,
                release_after,
                res.stats,
                verify_payload=self._verify_payload,
            )
        self._storer = Storer(
            lambda: res.client_factory("store"),
            res.pool,
            res.engine,
            self._tp_rank,
            res.stats,
            self.cfg.maru_async_store,
            report_settled=self._report_settled_stores,
        )
        if self._handoff is not None:
            self._handoff.attach_worker(head_start=self._start_head)

    # ---- before / during the forward -------------------------------------

    def handle_preemptions(self, meta: MaruConnectorMetadata) -> None:
        """Finish copies that touch blocks vLLM may reuse from this step on."""
        if self._storer is not None:
            self._storer.drain(meta.preempted_req_ids)
        if self._loader is not None:
            self._loader.drain(meta.preempted_req_ids | meta.finished_req_ids)

    def start_load_kv(self, meta: MaruConnectorMetadata) -> None:
        early = {spec.req_id: self._claim_early_pin(spec) for spec in meta.loads if spec.early_pin}
        if self._asleep:
            self._refuse_loads(meta, early)
            return
        for spec in meta.loads:
            if spec.is_async:
                if self._loader is None:
                    _release(early.get(spec.req_id))
                    raise RuntimeError("async load planned but maru_async_load is off")
                self._loader.submit(spec, early.get(spec.req_id))
            else:
                self._start_sync_load(spec, early.get(spec.req_id))
        if any(not load.overlapped for load in self._sync_loads):
            self._finish_sync_loads(only_whole=True)

    def wait_for_layer_load(self, layer_name: str, computing: Collection[str] | None = None) -> None:
        """Wait until this layer's KV of the loads the forward reads has landed.

        ``computing``: the requests this step's forward computes; released
        async loads of other requests are not waited for. None: wait for
        every released load.
        """
        if not self._sync_loads and (self._loader is None or not self._loader.num_in_flight):
            return
        position = self._layout.position(layer_name)
        start = time.perf_counter()
        for load in self._sync_loads:
            load.handle.wait_layer_on_device(position)  # a failure is found in _finish_sync_loads
        waited = time.perf_counter() - start
        if self._loader is not None:
            waited += self._loader.wait_layer(position, computing)
        self.stats.record_layer_wait(waited)

    # ---- after the forward -----------------------------------------------

    def wait_for_save(self, meta: MaruConnectorMetadata) -> None:
        self._finish_sync_loads()
        if self._storer is None:
            return
        if self._asleep:  # the blocks hold nothing: store nothing of them
            for _ in meta.stores:
                self.stats.record_store_failure("aborted")
            self._storer.settle_unrun(meta.stores)
            meta = replace(meta, stores=[])
        if meta.store_verdicts:
            self._storer.apply_verdicts(meta.store_verdicts)
        for spec in meta.stores:
            self._storer.submit(spec)

    def get_finished(self, meta: MaruConnectorMetadata) -> tuple[set[str], set[str], set[str]]:
        """(held requests whose stores are done, async loads released or
        failed, those of them that failed while parked: vLLM's
        ``failed_recving``, which recomputes them whatever their blocks).

        Also reports, as failures of this step, the released loads that
        failed and whose requests this step's forward computed.
        """
        self._finish_sync_loads()  # this step's report must hold their failures
        sending = self._storer.finished_requests(meta.held_req_ids) if self._storer else set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self._loader is not None:
            if not meta.scheduled_req_ids:
                # Every request is parked (or none runs): wait for the loader
                # here, GIL-free, rather than let the engine spin on empty steps.
                self._loader.wait_for_results(_IDLE_STEP_MAX_WAIT_S)
            results = self._loader.take_results(meta.scheduled_req_ids)
            failed = set(results.failed) | self._refused_async
            recving = results.released | failed
            self._refused_async = set()
            for req_id, blocks in results.failed.items():
                self._record_failure(req_id, blocks)
            for req_id, blocks in results.failed_after_release.items():
                logger.warning("KV copy for %s failed after its release; vLLM recomputes it", req_id)
                self._record_failure(req_id, blocks)
                if req_id in meta.scheduled_req_ids:  # this step's forward used the blocks
                    self._tainted = True
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_sync_loads()
        blocks, self._error_blocks = self._error_blocks, set()
        return blocks

    def build_worker_meta(self, meta: MaruConnectorMetadata) -> MaruWorkerMetadata:
        """This step's report; sent every step, so the scheduler can judge the step's stores."""
        self._finish_sync_loads()
        settled = tuple(self._storer.take_settled()) if self._storer is not None else ()
        report = MaruWorkerMetadata(meta.step, self._failed_req_ids, self._tainted, settled)
        self._failed_req_ids, self._tainted = set(), False
        return report

    # ---- sleep mode ----------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """Before vLLM releases the KV cache (sleep): finish every copy into
        or out of it, and start none until :meth:`restore_kv_caches`.

        Loads in flight land (their outcomes are reported as usual), queued
        stores are cancelled and copying ones finished. Idempotent.
        """
        if self._res is None or self._asleep:
            return
        self._asleep = True
        self._finish_sync_loads()
        if self._loader is not None:
            self._loader.wait_idle()
        if self._storer is not None:
            self._storer.drain_all()
        logger.info("KV cache released (sleep mode): no loads or stores until it is restored")

    def restore_kv_caches(self) -> None:
        """After wake-up: vLLM backs the KV cache again at the same addresses
        (its views and graphs stay valid), so the transfer plan still holds;
        loads and stores resume. Idempotent."""
        self._asleep = False

    def shutdown(self) -> None:
        if self._handoff is not None and self._res is not None:
            self._handoff.detach_worker()
        self._finish_sync_loads()
        if self._unpinner is not None:
            self._unpinner.shutdown(wait=True)  # every unpin sent before the lease ends
        for part in (self._loader, self._storer):
            if part is not None:
                part.close()
        if self._sync_client is not None:
            self._sync_client.close()
        if self._res is not None:
            self._res.close()

    # ---- synchronous loads -------------------------------------------------

    def _start_head(self, pin: EarlyPin, num_chunks: int) -> None:
        """Start copying the first layers of the hit ``pin`` holds (on the
        scheduler's thread, before vLLM allocates its blocks)."""
        res = self._res
        locations = pin.reply_if_back() if res is not None else None
        if res is None or locations is None:
            return
        sources = head_sources(locations, num_chunks, res.fmt.objects_per_chunk)
        if sources is not None:
            pin.attach_head(res.engine.start_head(sources))

    def _refuse_loads(self, meta: MaruConnectorMetadata, early: dict[str, EarlyPin | None]) -> None:
        """While asleep the blocks are not backed: every load fails (recompute)."""
        for spec in meta.loads:
            _release(early.get(spec.req_id))
            self._fail_sync(spec, "aborted", "the KV cache is released (sleep mode)")
            if spec.is_async:
                self._refused_async.add(spec.req_id)

    def _claim_early_pin(self, spec: LoadSpec) -> EarlyPin | None:
        return self._handoff.claim(spec.early_pin) if self._handoff is not None else None

    def _start_sync_load(self, spec: LoadSpec, early: EarlyPin | None = None) -> None:
        res = self._require_resources()
        try:
            if self._sync_client is None:
                self._sync_client = res.client_factory("sync")
            pinned = resolve_load(
                self._sync_client, res.pool, res.fmt, spec.keys(self._tp_rank), spec.block_ids,
                verify_payload=self._verify_payload, early=early,
            )
        except LoadFailure as exc:
            self._fail_sync(spec, exc.reason, str(exc))
            return
        except Exception as exc:  # e.g. the client could not connect
            _release(early)
            self._fail_sync(spec, "index_error", f"{type(exc).__name__}: {exc}")
            return
        if pinned.early is not None:
            self.stats.record_early_pinned_load()
        overlapped = self.cfg.maru_overlap_load_with_compute and not spec.wait_whole
        handle = res.engine.submit_load(
            pinned.chunks, beside_long_forward=overlapped and spec.new_tokens >= self.cfg.maru_kv_chunk_tokens,
            head=pinned.head, check=pinned.check)
        if getattr(handle, "head_start", False):
            self.stats.record_head_start_load()
        self._sync_loads.append(_SyncLoad(spec, pinned, handle, overlapped))

    def _finish_sync_loads(self, only_whole: bool = False) -> None:
        """Wait for the sync loads, release their pins, report failures;
        ``only_whole``: just those the forward does not overlap."""
        loads = self._sync_loads
        if only_whole:
            self._sync_loads = [load for load in loads if load.overlapped]
            loads = [load for load in loads if not load.overlapped]
        else:
            self._sync_loads = []
        for load in loads:
            started = load.handle.submitted_at
            wait_done(load.handle)
            self._release_later(load.pinned)
            if load.handle.error is not None:
                self._fail_sync(load.spec, copy_failure_reason(load.handle.error), repr(load.handle.error))
                continue
            self.stats.record_load(load.handle.nbytes, time.monotonic() - started)
            logger.debug("hit %s: %d tokens, %d bytes loaded (%s)", load.spec.req_id,
                         len(load.spec.all_block_ids()) * self._block_size, load.handle.nbytes,
                         "overlap" if load.overlapped else "sync")

    def _release_later(self, pinned: PinnedLoad) -> None:
        """Give a finished sync load's pins back off the engine thread: every
        copy from its slots completed, so only the index's round trip is left,
        and the step need not wait for it."""
        if pinned.early is not None:
            release_pins(self._sync_client, pinned)  # queues the unpin on the pins' own thread
            return
        if self._unpinner is None:
            self._unpinner = ThreadPoolExecutor(1, thread_name_prefix="maru-unpin")
        self._unpinner.submit(release_pins, self._sync_client, pinned)

    def _fail_sync(self, spec: LoadSpec, reason: str, detail: str) -> None:
        logger.warning("KV load for %s failed (%s); vLLM recomputes it", spec.req_id, detail)
        self.stats.record_load_failure(reason)
        self._record_failure(spec.req_id, spec.all_block_ids())
        self._tainted = True  # this step's forward computes on top of the unloaded blocks

    def _record_failure(self, req_id: str, blocks: list[int]) -> None:
        self._error_blocks.update(blocks)
        self._failed_req_ids.add(req_id)

    def _require_resources(self) -> WorkerResources:
        if self._res is None:
            raise RuntimeError("register_kv_caches has not been called on this worker")
        return self._res


def _release(early: EarlyPin | None) -> None:
    if early is not None:
        early.release()
