"""``MaruKVConnector``: vLLM's KV connector for MaruCache. Routing only.

The connector checks its role once and hands every call to the scheduler half
(:mod:`maru_connector.scheduler`) or the worker half
(:mod:`maru_connector.worker`); the halves talk only through the typed
messages of :mod:`maru_connector.metadata`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from maru_connector.config import MaruConfig, parse_config
from maru_connector.early_pins import PinHandoff
from maru_connector.identity import base_namespaces, block_size_of, check_engine_supported
from maru_connector.kv_events import kv_events_enabled
from maru_connector.log import get_logger, repeats
from maru_connector.lookup import LookupService
from maru_connector.metadata import MaruConnectorMetadata
from maru_connector.preflight import check_before_load, startup_line
from maru_connector.scheduler import MaruSchedulerHalf
from maru_connector.stats import open_stats
from maru_connector.transfer.backend import TransferBackend
from maru_connector.vllm_stats import MaruKVConnectorStats, MaruPromMetrics, StepStatsReader
from maru_connector.worker import MaruWorkerHalf

if TYPE_CHECKING:
    import torch
    from maru_core.pool.pool_identity import PoolIdentity
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # no TP group (single-process tools): rank 0
        return 0


def _workers_pool(cfg: MaruConfig, token: str | None) -> tuple[PoolIdentity, str]:
    """The pool region this engine's workers map, found without mapping it, and its index:
    from the sidecar's hand-off (its descriptor closed at once) or from the pool file's header."""
    from maru_core.pool.pool_identity import PoolIdentity

    if cfg.maru_sidecar_socket is None:
        assert cfg.maru_pool_path is not None, "parse_config sets exactly one of the two"
        return PoolIdentity.read(cfg.maru_pool_path), cfg.resolve_index_url()
    from maru_core.handoff import fetch_pool

    handoff = fetch_pool(cfg.maru_sidecar_socket, token, cfg.maru_cache_name,
                         timeout_s=max(1.0, cfg.maru_lookup_timeout_s))
    os.close(handoff.fd)
    return handoff.pool_identity(), cfg.resolve_index_url(handoff.index_url)


def _make_lookup(cfg: MaruConfig) -> LookupService:
    from maru_core.index.client import IndexClient

    token = cfg.resolve_token()
    pool: list[tuple[PoolIdentity, str]] = []  # found on the first lookup (on the lookup's thread), then kept

    def client() -> IndexClient:
        # The lookup's hits and early pins name offsets the workers read in their
        # pool: an index serving another region is refused (WrongPool), as the workers' are.
        if not pool:
            pool.append(_workers_pool(cfg, token))
        return IndexClient(
            pool[0][1],
            token=token,
            client_name=f"maru-scheduler-{os.getpid()}",
            timeout_s=max(1.0, cfg.maru_lookup_timeout_s),
            pool=pool[0][0],
        )

    return LookupService(client, timeout_s=cfg.maru_lookup_timeout_s)


def _workers_backend(vllm_config: "VllmConfig") -> TransferBackend:
    """The workers' transfer backend, from the device vLLM runs on, as the
    workers pick it (``auto``): what parts of a chunk they load."""
    on_cuda = getattr(vllm_config.device_config, "device_type", "cpu") == "cuda"
    return TransferBackend.for_device("auto", on_cuda)


class MaruKVConnector(KVConnectorBase_V1):
    """Shares prefix KV between vLLM engines through a MaruCache pool."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_engine_supported(vllm_config, kv_cache_config)
        block_size = block_size_of(kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        cfg = parse_config(extra, block_size)
        checked = check_before_load(extra)  # done already if vLLM asked the class before loading the model
        self.scheduler_half: MaruSchedulerHalf | None = None
        self.worker_half: MaruWorkerHalf | None = None
        self._step_stats = StepStatsReader()  # this half's figures for vLLM's own stats
        # Both halves of one engine find each other here when vLLM runs them in one process.
        engine_id = self._kv_transfer_config.engine_id
        handoff = PinHandoff.for_engine(engine_id) if cfg.maru_early_pins and engine_id else None
        if role == KVConnectorRole.SCHEDULER:
            namespaces = base_namespaces(vllm_config, kv_cache_config, cfg)
            num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
            self.scheduler_half = MaruSchedulerHalf(
                cfg, namespaces, block_size, _make_lookup(cfg), num_layers=num_layers,
                stats=open_stats(cfg, "scheduler"), handoff=handoff, kv_events=kv_events_enabled(vllm_config),
                partial_chunk_loads=_workers_backend(vllm_config).partial_chunk_loads,
                block_alias_loads=_workers_backend(vllm_config).block_alias_loads,
            )
            logger.info("%s", startup_line("scheduler", checked))
        else:
            tp_rank = _tp_rank()
            self.worker_half = MaruWorkerHalf(cfg, tp_rank, block_size, handoff=handoff,
                                              report_settled_stores=kv_events_enabled(vllm_config))
            if tp_rank == 0:
                logger.info("%s", startup_line("worker", checked))

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped store is only a future miss.
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True whenever a forward may run while a load is still landing.

        A FULL CUDA graph replays attention without calling
        ``wait_for_layer_load``, so the forward would read blocks still being
        written; PIECEWISE keeps attention (and our waits) outside the graphs.
        Only ``maru_overlap_load_with_compute`` lets a forward start before
        every layer landed. vLLM asks while it resolves its configuration,
        before it loads the model: the whole configuration is checked here
        (preflight.py).
        """
        return check_before_load(extra_config).cfg.maru_overlap_load_with_compute

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: "KVTransferConfig") -> Any:
        """vLLM's own answer (0.34 on); vLLM asks while it resolves its configuration,
        in every set-up, before it loads the model: the configuration is checked here."""
        check_before_load(kv_transfer_config.kv_connector_extra_config)
        return getattr(super(), "kv_cache_access")(kv_transfer_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """No layout required. vLLM 0.32 without CUDA graphs asks this first (after
        the weights, before it sizes the KV cache): the configuration is checked here."""
        if vllm_config.kv_transfer_config is not None:
            check_before_load(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return super().get_required_kvcache_layout(vllm_config)

    # ---- vLLM's connector stats (vllm_stats.py) -----------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This half's counters since vLLM last asked (each worker and the scheduler, every step)."""
        half = self.worker_half if self.worker_half is not None else self.scheduler_half
        return self._step_stats.take(half.stats) if half is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return MaruKVConnectorStats(data=dict(data) if data is not None else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type["PromMetric"], type["PromMetricT"]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> MaruPromMetrics:
        return MaruPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side --------------------------------------------------------

    def _worker(self) -> MaruWorkerHalf:
        if self.worker_half is None:
            raise RuntimeError("worker-side call on the scheduler-side MaruKVConnector")
        return self.worker_half

    def _meta(self) -> MaruConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, MaruConnectorMetadata):
            raise TypeError(f"expected MaruConnectorMetadata, got {type(meta).__name__}")
        return meta

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33 on, before sleep mode releases the KV cache.
        self._worker().unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._worker().restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, MaruConnectorMetadata):
            self._worker().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name, self._meta().scheduled_req_ids)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: "torch.Tensor",
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        # Stores copy whole chunks after the forward (wait_for_save).
        return

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._worker().get_finished(self._meta())
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker().get_finished(self._meta())
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().build_worker_meta(self._meta())

    def shutdown(self) -> None:
        if self.worker_half is not None:
            self.worker_half.shutdown()
        if self.scheduler_half is not None:
            self.scheduler_half.shutdown()
        repeats.flush()  # the counts of warnings still held back

    # ---- scheduler side -----------------------------------------------------

    def _scheduler(self) -> MaruSchedulerHalf:
        if self.scheduler_half is None:
            raise RuntimeError("scheduler-side call on the worker-side MaruKVConnector")
        return self.scheduler_half

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: "Request") -> bool:
        return self._scheduler().may_load_async(request)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        # Stored and removed pool chunks, for routers (kv_events.py).
        return self._scheduler().take_events()

    def has_pending_push_work(self) -> bool:
        # Stores wait for a verdict that only a further step delivers.
        return self.scheduler_half is not None and self.scheduler_half.has_pending_push_work()
