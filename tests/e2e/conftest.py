"""Fixtures for the end-to-end tests: real vLLM CPU engines on a real index and pool.

Everything here is scoped to this package: one pool and index, one fault
proxy in front of it, one reference engine without the connector, and an
engine farm that starts each connector configuration once and shares it
between tests (an engine start costs tens of seconds on two cores). They end
with the package's last test, so the engines do not idle beside the
operator and sidecar tests that run after it.

Tests isolate themselves by prompt, not by pool: every test draws its own
prompts (distinct seeds), so its keys are its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru_connector.config import make_kv_transfer_config
from maru_tools.cluster import CacheEngine, EngineFarm, wait_until
from maru_tools.engine import EngineSpec, prefix_kv_mismatch
from maru_tools.index_process import IndexProcess
from maru_tools.sidecar_process import SidecarProcess
from maru_tools.tiny_model import TinyModelSpec, build_tiny_model

from .fault_proxy import FaultProxy

BLOCK_SIZE = 32
CHUNK_TOKENS = 64
NUM_LAYERS = 4
MODEL_SPEC = TinyModelSpec(num_layers=NUM_LAYERS, seed=0)
OTHER_MODEL_SPEC = TinyModelSpec(num_layers=NUM_LAYERS, seed=1)

# Lookups on a loaded two-core machine can take longer than the production
# default; the outage tests set their own short timeout.
TEST_KNOBS: dict[str, Any] = {
    "kv_chunk_tokens": CHUNK_TOKENS,
    "lookup_timeout_s": 2.0,
    "load_timeout_s": 10.0,
}


@pytest.fixture(scope="package")
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="marucache-e2e-")
    yield path
    # MARUCACHE_E2E_KEEP=1 keeps the engine and index logs for a post-mortem.
    if os.environ.get("MARUCACHE_E2E_KEEP") != "1":
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="package")
def model_dir() -> str:
    return str(build_tiny_model(MODEL_SPEC))


@pytest.fixture(scope="package")
def other_model_dir() -> str:
    return str(build_tiny_model(OTHER_MODEL_SPEC))


@pytest.fixture(scope="package")
def index(workdir: str) -> Iterator[IndexProcess]:
    # Room for every test's stores: a pool at its eviction watermark evicts as
    # it commits, and tests that wait for their keys to appear would wait in vain.
    proc = IndexProcess(pool_size="2Gi", log_dir=workdir)
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def private_index(workdir: str) -> Iterator[IndexProcess]:
    """An index of the module's own, for tests that stop and restart it."""
    proc = IndexProcess(pool_size="128Mi", log_dir=workdir)
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="package")
def proxy(index: IndexProcess) -> Iterator[FaultProxy]:
    with FaultProxy(index.port, index.pool_path) as p:
        yield p


@pytest.fixture(scope="package")
def farm(workdir: str, model_dir: str) -> Iterator[EngineFarm]:
    base = EngineSpec(
        model_dir=model_dir,
        block_size=BLOCK_SIZE,
        max_model_len=4096,
        max_num_batched_tokens=2048,
        num_gpu_blocks_override=1024,
    )
    farm = EngineFarm(workdir, base, max_alive=int(os.environ.get("MARUCACHE_E2E_MAX_ENGINES", "6")))
    yield farm
    farm.close()


def connector_config(index: IndexProcess, url: str | None = None, **knobs: Any):
    """A `kv_transfer_config(stats_dir)` factory for `EngineFarm.get` (direct attach)."""
    merged = {**TEST_KNOBS, **knobs}

    def build(stats_dir: str) -> dict[str, Any]:
        return make_kv_transfer_config(
            url or index.url, pool_path=index.pool_path, token=index.token, stats_dir=stats_dir, **merged
        )

    return build


SIDECAR_CACHE = "e2e"
SIDECAR_NAMESPACE = "e2e-ns"


class Sidecars:
    """One real `marucache sidecar` per engine, as in a pod: `config(pod)` is a
    `kv_transfer_config(stats_dir)` factory that starts a sidecar whose socket
    lies in the engine's stats directory and points the connector at it.

    As the operator sets a pod up, the sidecar holds the cache token and writes
    its pod's credential beside the socket (`--credential-file`), and the
    connector presents that credential, never the cache token, to the
    hand-off and to the index."""

    def __init__(self, index: IndexProcess):
        self._index = index
        self.by_stats_dir: dict[str, SidecarProcess] = {}

    def config(self, pod: str, **knobs: Any):
        def build(stats_dir: str) -> dict[str, Any]:
            credential = Path(stats_dir) / "credential"
            sidecar = SidecarProcess(
                self._index.pool_path, Path(stats_dir) / "maru.sock", self._index.url,
                token_file=self._index.token_file, cache=SIDECAR_CACHE,
                credential_file=credential, pod=f"{SIDECAR_NAMESPACE}/{pod}",
            )  # fmt: skip
            self.by_stats_dir[stats_dir] = sidecar
            sidecar.start()
            sidecar.wait_ready()
            return make_kv_transfer_config(
                self._index.url, sidecar_socket=str(sidecar.socket_path), token_file=str(credential),
                cache_name=SIDECAR_CACHE, **{**TEST_KNOBS, **knobs},
            )  # fmt: skip

        return build

    def of(self, engine: CacheEngine) -> SidecarProcess:
        return self.by_stats_dir[engine.stats_dir]

    def close(self) -> None:
        for sidecar in self.by_stats_dir.values():
            sidecar.close()


@pytest.fixture(scope="package")
def sidecars(index: IndexProcess) -> Iterator[Sidecars]:
    started = Sidecars(index)
    yield started
    started.close()


@pytest.fixture(scope="package")
def reference(farm: EngineFarm) -> "Reference":
    return Reference(farm)


class Reference:
    """Greedy outputs of an engine without the connector, memoised per prompt."""

    def __init__(self, farm: EngineFarm):
        self._farm = farm
        self._memo: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def outputs(self, prompts: list[list[int]], max_tokens: int = 8, model: str = "a", **overrides: Any) -> list[list[int]]:
        missing = [p for p in prompts if (model, tuple(p), max_tokens) not in self._memo]
        if missing:
            engine = self._farm.get(f"reference-{model}", None, **overrides)
            for prompt, out in zip(missing, engine.outputs(missing, max_tokens)):
                self._memo[(model, tuple(prompt), max_tokens)] = out
        return [self._memo[(model, tuple(p), max_tokens)] for p in prompts]


def assert_same_prefix_kv(written: bytes | None, read: bytes | None, num_tokens: int, prefix_tokens: int) -> None:
    """The first ``prefix_tokens`` positions of two dumps of one prompt's KV
    (``generate(dump_kv=True)``) are byte-identical in every layer."""
    where = prefix_kv_mismatch(written, read, num_tokens, num_tokens, prefix_tokens, NUM_LAYERS)
    assert where is None, (f"layer {where[0]}: the loaded KV differs from the computed KV from "
                           f"position {where[1]} on (of a {prefix_tokens}-token prefix)")


def pool_state(index: IndexProcess) -> dict[str, Any]:
    return index.stats()


def wait_for_keys(index: IndexProcess, at_least: int, timeout_s: float = 30.0) -> int:
    """Wait until the index holds at least `at_least` committed keys (stores are async)."""
    return wait_until(lambda: (k := index_keys(index)) >= at_least and k, timeout_s, what=f">= {at_least} keys")


def index_keys(index: IndexProcess) -> int:
    return int(index.stats()["keys"])


def wait_settled(index: IndexProcess, timeout_s: float = 30.0, baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Wait until nothing is pinned or reserved (or no more than in `baseline`,
    the stats taken when the test began, so that one test's leak does not fail
    the tests after it); returns the stats that showed it."""
    allowed_pinned = pinned_bytes(baseline) if baseline else 0
    allowed_reserved = reserved_bytes(baseline) if baseline else 0
    last: dict[str, Any] = {}

    def settled():
        last.update(index.stats())
        ok = pinned_bytes(last) <= allowed_pinned and reserved_bytes(last) <= allowed_reserved
        return dict(last) if ok else None

    try:
        return wait_until(settled, timeout_s, interval_s=0.2, what="no pins or reservations")
    except TimeoutError:
        raise AssertionError(
            f"pins or reservations left after {timeout_s}s: pinned {last.get('pinned_keys')} keys "
            f"({pinned_bytes(last)} bytes), reserved {last.get('reserved_keys')} keys "
            f"({reserved_bytes(last)} bytes); at the start of the test: pinned {allowed_pinned}, "
            f"reserved {allowed_reserved} bytes"
        ) from None


def no_pins_or_reservations(stats: dict[str, Any]) -> bool:
    return pinned_bytes(stats) == 0 and reserved_bytes(stats) == 0


def pinned_bytes(stats: dict[str, Any]) -> int:
    return int(_pool_bytes(stats, "pinned"))


def reserved_bytes(stats: dict[str, Any]) -> int:
    return int(_pool_bytes(stats, "reserved"))


def _pool_bytes(stats: dict[str, Any], state: str) -> int:
    if isinstance(stats.get("pool_bytes"), dict):
        return stats["pool_bytes"][state]
    return stats[f"{state}_bytes"]


__all__ = ["CacheEngine", "connector_config", "wait_for_keys", "wait_settled", "index_keys"]
