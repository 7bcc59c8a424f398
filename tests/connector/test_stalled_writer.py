"""A writer process frozen past its lease and the fence's grace resumes and
copies into pages another writer has committed since: fencing no longer
holds those pages, the slot header still names the committed object, and
only the payload checksum can tell. A verified load then fails (vLLM
recomputes) instead of serving the late writer's bytes: whether the late
copy lands before the reader's load, or between the reader's checks of the
slot headers and its copies (the bytes are checked where they landed).

Real parts: the stalled writer is its own process (SIGSTOP / SIGCONT) with
a real index client whose heartbeats stop with it; the index runs on
loopback; the fast writer and the reader are connector worker halves on the
real CPU transfer engine, with the default ``maru_verify_payload``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from maru_core.index.client import IndexClient
from maru_core.index.launcher import ThreadedIndex
from maru_core.keys import KeyNamespace, chunk_keys
from maru_core.pool import Pool
import torch

from maru_connector.config import parse_config
from maru_connector.resolve import object_keys
from maru_connector.stats import open_stats
from maru_connector.transfer import TransferEngine, create_engine
from maru_connector.worker import MaruWorkerHalf, WorkerResources

from kv_builders import make_kv_caches
from worker_env import BLOCK, CHUNK, LAYERS, load_meta, step, store_meta, tokens

TOKEN = "stall-token"
LEASE_TTL_S = 1.0
RESERVATION_TTL_S = 0.3  # also the fence's grace after the lease ends
NAMESPACE = KeyNamespace(model="tiny", dtype="bfloat16", kv_dtype="auto", layout="cpu/test",
                         block_size=BLOCK, chunk_tokens=CHUNK)

STALLED_WRITER = textwrap.dedent("""
    import sys
    from maru_core.index.client import IndexClient
    from maru_core.pool import Pool

    url, token, path = sys.argv[1:4]
    pool = Pool.attach(path)
    g = pool.geometry
    client = IndexClient(url, token=token, client_name="stalled")
    length = g.num_pages * g.page_size  # every page of the pool
    (slot,) = client.reserve([(b"S" * 16, length)])
    print(slot.offset, length, flush=True)
    sys.stdin.readline()  # frozen here (SIGSTOP), then told to copy
    pool.buffer[slot.offset : slot.offset + length] = b"\\xee" * length  # the late copy
    print("copied", flush=True)
""")


class Cluster:
    """A pool, an index on loopback, and worker halves with real index clients."""

    def __init__(self) -> None:
        self.path = f"/dev/shm/maru-stall-test-{uuid.uuid4().hex}"
        self.pool = Pool.create(self.path, 4 << 20, page_size=4096)
        self.index = ThreadedIndex(self.pool, token=TOKEN, lease_ttl_s=LEASE_TTL_S,
                                   reservation_ttl_s=RESERVATION_TTL_S, expiry_interval_s=0.1).start()
        self.workers: list[MaruWorkerHalf] = []

    def client(self, name: str) -> IndexClient:
        return IndexClient(self.index.url, token=TOKEN, client_name=name)

    def worker(self, seed: int, wrap_engine=None, **knobs):
        raw = {"maru_index_url": self.index.url, "maru_pool_path": self.path, "maru_kv_chunk_tokens": CHUNK,
               "maru_async_store": False, **knobs}
        cfg = parse_config(raw, BLOCK)
        kv = make_kv_caches("cpu", layers=LAYERS, blocks=32, heads=2, block_size=BLOCK, head_size=8,
                            dtype=torch.bfloat16, seed=seed, shuffle=False)

        def resources(cfg, kv_caches, block_size):
            fmt = TransferEngine.detect(kv_caches, cfg.maru_kv_chunk_tokens, cfg.maru_use_layerwise, block_size)
            pool = Pool.attach(self.path)
            engine = create_engine(pool.buffer, kv_caches, fmt)
            engine = wrap_engine(engine) if wrap_engine is not None else engine
            return WorkerResources(pool, engine, lambda role: self.client(f"{role}-{seed}"),
                                   open_stats(cfg, "worker"))

        half = MaruWorkerHalf(cfg, tp_rank=0, block_size=BLOCK, resources_factory=resources)
        half.register_kv_caches(kv)
        self.workers.append(half)
        return half, kv

    def fenced_pages(self) -> int:
        return self.index.on_loop(lambda: self.index.service.server.registry.fenced_pages)

    def reservation(self, key: bytes):
        return self.index.on_loop(lambda: self.index.service.server.registry.describe(key))

    def close(self) -> None:
        for half in self.workers:
            half.shutdown()
        self.index.stop()
        self.pool.close()
        os.unlink(self.path)


class StalledWriter:
    """The writer process: it reserves every page, then waits to be told to copy."""

    def __init__(self, cluster: Cluster) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STALLED_WRITER, cluster.index.url, TOKEN, cluster.path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        offset, length = map(int, self.proc.stdout.readline().split())
        self.extent = (offset, offset + length)

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume_and_copy(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        os.kill(self.proc.pid, signal.SIGCONT)
        assert self.proc.stdout.readline().strip() == "copied"
        self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def cluster():
    cluster = Cluster()
    yield cluster
    cluster.close()


class ReaderEngine:
    """The reader's CPU engine, as the worker sees it: ``backend`` as given (the
    worker takes its default ``maru_verify_payload`` from it), and with
    ``writer``, the stalled writer copies between the reader's slot checks
    (done when ``submit_load`` is called) and the reader's copies."""

    def __init__(self, engine, backend: str, writer: StalledWriter | None) -> None:
        self._engine, self.backend, self._writer = engine, backend, writer

    def submit_load(self, chunks, **options):
        if self._writer is not None:
            self._writer.resume_and_copy()
        return self._engine.submit_load(chunks, **options)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize("late_copy", ["before_the_load", "between_the_checks_and_the_copies"])
@pytest.mark.parametrize("default_of", ["cpu", "cuda"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_a_writer_frozen_past_its_lease_and_grace_cannot_get_its_late_copy_served(cluster, layerwise, default_of,
                                                                                    late_copy):
    """``default_of``: the backend whose default ``maru_verify_payload`` the reader
    runs with (its copies are the CPU engine's either way)."""
    stalled = StalledWriter(cluster)
    try:
        stalled.freeze()  # its heartbeats stop with it
        # Its reservation lapses (its pages fenced), then its lease, then the grace.
        _wait_for(lambda: cluster.reservation(b"S" * 16) is None and cluster.fenced_pages() == 0,
                  "the fence to release the stalled writer's pages")
        # Lease lapsed, grace over: its pages go to the next writer, which stores and commits.
        writer, _ = cluster.worker(seed=1, maru_use_layerwise=layerwise)
        keys = chunk_keys(NAMESPACE, tokens(64))
        step(writer, store_meta("w", keys, first_block=0))
        with cluster.client("check") as check:
            fmt = writer._res.engine.fmt
            locations = check.retrieve(object_keys(fmt, keys))
            assert all(loc is not None for loc in locations), "the fast writer's objects were not committed"
            assert all(stalled.extent[0] <= loc.offset < stalled.extent[1] for loc in locations)
            check.unpin(object_keys(fmt, keys))

        if late_copy == "before_the_load":
            stalled.resume_and_copy()
        copies_late = stalled if late_copy != "before_the_load" else None
        reader, _ = cluster.worker(seed=2, maru_use_layerwise=layerwise,
                                   wrap_engine=lambda engine: ReaderEngine(engine, default_of, copies_late))
        errors, report = step(reader, load_meta("r", keys, first_block=10))
        assert errors == set(range(10, 10 + 2 * len(keys))), "the late writer's bytes were served as KV"
        assert report.failed_load_req_ids == {"r"}
        assert reader.stats.snapshot()["load_failures"]["header_mismatch"] == 1
    finally:
        stalled.kill()


def _wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
