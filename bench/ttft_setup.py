"""The pieces the TTFT benchmark runs on: a real ``marucache index`` process
and its pool in ``/dev/shm`` (registered with CUDA once, as one vLLM worker
would), and engines built in each connector mode."""

from __future__ import annotations

import torch
from maru_core.keys import KeyNamespace
from maru_core.pool import Pool

from maru_connector.config import parse_config
from maru_connector.early_pins import PinHandoff
from maru_connector.lookup import LookupService
from maru_connector.scheduler import MaruSchedulerHalf
from maru_connector.stats import open_stats
from maru_tools.index_process import IndexProcess
from maru_connector.transfer import TransferEngine, create_engine
from maru_connector.worker import MaruWorkerHalf, WorkerResources

from ttft_driver import Engine

# mode -> (connector knobs, transfer-engine options on CUDA, piecewise CUDA graphs).
# The async modes park every hit (maru_park_lone_hits): a lone hit would
# otherwise load in the step computing it, which is what the sync modes measure.
SYNC = {"maru_async_load": False}
PARKED = {"maru_async_load": True, "maru_park_lone_hits": True}
WHOLE, OVERLAP = {"maru_overlap_load_with_compute": False}, {"maru_overlap_load_with_compute": True}
MODES = {
    "sync": ({**SYNC, **WHOLE}, {}, False),
    "sync_overlap": ({**SYNC, **OVERLAP}, {}, False),
    "async": ({**PARKED, **WHOLE}, {}, False),
    "async_overlap": ({**PARKED, **OVERLAP}, {}, False),
    "sync_overlap_graphs": ({**SYNC, **OVERLAP}, {}, True),
    "async_overlap_graphs": ({**PARKED, **OVERLAP}, {}, True),
    # the default async choice: park a hit only beside other live requests
    "async_auto": ({"maru_async_load": True, **OVERLAP}, {}, False),
    "async_auto_graphs": ({"maru_async_load": True, **OVERLAP}, {}, True),
    # Loads check the bytes they receive against the writers' checksums by
    # default (maru_verify_payload); these modes say so, or turn it off.
    "sync_overlap_verify": ({**SYNC, **OVERLAP, "maru_verify_payload": True}, {}, False),
    "sync_unverified": ({**SYNC, **WHOLE, "maru_verify_payload": False}, {}, False),
    "sync_overlap_unverified": ({**SYNC, **OVERLAP, "maru_verify_payload": False}, {}, False),
    "async_overlap_unverified": ({**PARKED, **OVERLAP, "maru_verify_payload": False}, {}, False),
    "sync_overlap_graphs_unverified": ({**SYNC, **OVERLAP, "maru_verify_payload": False}, {}, True),
    # the load and scatter streams at the default priority, as before
    "sync_overlap_prio0": ({**SYNC, **OVERLAP}, {"load_priority": 0}, False),
}
STORE = ({"maru_async_store": True}, {}, False)


class _SharedPool:
    """The cluster's one mapping of the pool, lent to every worker."""

    def __init__(self, pool):
        self._pool = pool

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def close(self) -> None:  # the cluster closes it
        return None


class Cluster:
    """An index process, its pool, and a factory of engines of one format."""

    def __init__(self, model, args, fmt: str, pool_bytes: int):
        self.model, self.args, self.fmt = model, args, fmt
        self.index = IndexProcess(pool_size=str(pool_bytes))
        self.registered = False

    def __enter__(self) -> "Cluster":
        self.index.start(timeout_s=120)
        self.pool = Pool.attach(self.index.pool_path)
        if self.model.device.type == "cuda":
            from maru_connector.transfer.cudart import register_host

            view = torch.frombuffer(self.pool.buffer, dtype=torch.uint8)
            self._ptr = view.data_ptr()
            self.registered = register_host(self._ptr, view.numel())
            del view
        return self

    def __exit__(self, *exc) -> None:
        if self.registered:
            from maru_connector.transfer.cudart import unregister_host

            torch.cuda.synchronize()
            unregister_host(self._ptr)
        self.pool.close()
        self.index.close()

    def engine(self, kv_caches: dict, fmt: str, mode: str, timing: bool = False) -> Engine:
        """``timing``: the transfer engine records when each layer lands (CUDA)."""
        knobs, options, graphs = STORE if mode == "store" else MODES[mode]
        args = self.args
        raw = {"maru_index_url": self.index.url, "maru_token": self.index.token,
               "maru_pool_path": self.index.pool_path,
               "maru_kv_chunk_tokens": args.chunk_tokens,
               "maru_use_layerwise": fmt == "layerwise",
               "maru_early_pins": not getattr(args, "no_early_pins", False), **knobs}
        if getattr(args, "verify_payload", None) is not None and "maru_verify_payload" not in knobs:
            raw["maru_verify_payload"] = args.verify_payload == "on"  # --verify-payload: every other mode
        cfg = parse_config(raw, args.block_size)
        device = self.model.device.type
        ns = self.namespace(cfg.fmt_name)
        options = {**options, **({"timing": True} if timing else {})} if device == "cuda" else {}
        index = self.index

        def client(role="bench"):
            return index.client(timeout_s=10)

        def resources(cfg, kv, block_size):
            fmt_ = TransferEngine.detect(kv, cfg.maru_kv_chunk_tokens, cfg.maru_use_layerwise,
                                         block_size)
            engine = create_engine(self.pool.buffer, kv, fmt_, **options)
            return WorkerResources(_SharedPool(self.pool), engine, client,
                                   open_stats(cfg, "worker"))

        # Both halves in one process, as vLLM's uni-process executor runs them.
        handoff = PinHandoff() if cfg.maru_early_pins else None
        scheduler = MaruSchedulerHalf(
            cfg, (ns,), args.block_size, LookupService(client, timeout_s=1.0,
                                   one_round_trip=not getattr(args, "two_round_trip_pins", False)),
            num_layers=self.model.geo.layers, handoff=handoff)
        worker = MaruWorkerHalf(cfg, 0, args.block_size, resources_factory=resources, handoff=handoff)
        worker.register_kv_caches(kv_caches)
        return Engine(self.model, kv_caches, args.block_size, scheduler, worker, graphs=graphs,
                      max_batched_tokens=args.max_batched_tokens)

    def namespace(self, fmt_name: str) -> KeyNamespace:
        args = self.args
        return KeyNamespace(model="llama-stand-in", dtype="bfloat16", kv_dtype="auto",
                            layout=f"{self.model.device.type}/packed",
                            block_size=args.block_size, chunk_tokens=args.chunk_tokens,
                            fmt=fmt_name)

    def transfer_engine(self, kv_caches: dict, layerwise: bool) -> TransferEngine:
        fmt = TransferEngine.detect(kv_caches, self.args.chunk_tokens, layerwise,
                                    self.args.block_size)
        return create_engine(self.pool.buffer, kv_caches, fmt)

    @staticmethod
    def close_engine(engine: Engine) -> None:
        engine.worker.shutdown()
        engine.scheduler.shutdown()
