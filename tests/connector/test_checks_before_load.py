"""A configuration the connector cannot run with stops vLLM before it loads the model,
and the index address comes from the sidecar's hand-off.

vLLM builds the connector only once the model is loaded and its KV cache
sized; it resolves its configuration (``VllmConfig``) before any of that, in
the process that starts the engine, and asks the connector's class there
(``kv_cache_access`` from vLLM 0.34 on, ``requires_piecewise_for_cudagraph``
whenever CUDA graphs are on). A bad key, a token or cache name the sidecar
refuses, or an index address other than the sidecar's, must fail that
resolution. Real parts: vLLM's own ``VllmConfig``, a real index process and
a real ``marucache sidecar`` process on its pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from vllm.config import CompilationConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.platforms import current_platform

from kv_builders import make_kv_caches
from maru_connector.config import MaruConfigError, make_kv_transfer_config, parse_config
from maru_connector.connector import _make_lookup
from maru_connector.preflight import check_before_load, startup_line
from maru_connector.worker import open_resources
from maru_core.pool import SlotHeader
from maru_tools.index_process import IndexProcess
from maru_tools.sidecar_process import SidecarProcess
from maru_tools.tiny_model import TinyModelSpec, build_tiny_model

BLOCK = 16
CACHE = "c1"


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_tiny_model(TinyModelSpec(num_layers=2, seed=0)))


@pytest.fixture(scope="module")
def index() -> Iterator[IndexProcess]:
    proc = IndexProcess(pool_size="16Mi")
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def sidecar(index, tmp_path_factory) -> Iterator[SidecarProcess]:
    sock_dir = tmp_path_factory.mktemp("sock")
    with SidecarProcess(index.pool_path, sock_dir / "maru.sock", index.url, token_file=index.token_file,
                        cache=CACHE) as proc:
        yield proc


def _resolve_vllm_config(model_dir: str, kv: dict) -> VllmConfig:
    """vLLM's configuration resolution, as ``vllm serve`` or ``LLM(...)`` runs it before
    starting the engine. vLLM 0.34 asks the connector in every set-up; 0.32 when
    CUDA graphs are on (the GPU default: the CPU platform is presented as one).
    The platform's own adjustments are left out (0.34's CPU platform wants Triton)."""
    platform = type(current_platform)
    patches = contextlib.ExitStack()
    patches.enter_context(mock.patch.object(platform, "check_and_update_config", classmethod(lambda c, v: None)))
    if not hasattr(KVConnectorBase_V1, "kv_cache_access"):
        patches.enter_context(mock.patch.object(platform, "support_static_graph_mode", classmethod(lambda c: True)))
    with patches:
        return VllmConfig(
            model_config=ModelConfig(model=model_dir, tokenizer=model_dir, dtype="float32", skip_tokenizer_init=True),
            kv_transfer_config=KVTransferConfig(**kv),
            compilation_config=CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE"),
        )


def _stops_vllm(match: str):
    """The error vLLM's configuration resolution raises: our MaruConfigError (a
    ValueError), which vLLM's pydantic config wraps with its message intact."""
    return pytest.raises(ValueError, match=match)


def _sidecar_config(sidecar: SidecarProcess, **knobs) -> dict:
    return make_kv_transfer_config(knobs.pop("index_url", None), sidecar_socket=str(sidecar.socket_path),
                                   **{"cache_name": CACHE, "lookup_timeout_s": 2.0, **knobs})


def test_a_good_configuration_resolves(model_dir, index, sidecar):
    _resolve_vllm_config(model_dir, _sidecar_config(sidecar, token_file=index.token_file))


def test_a_misspelt_key_stops_vllm_before_the_model_loads(model_dir, index):
    kv = make_kv_transfer_config(index.url, pool_path=index.pool_path, token=index.token)
    kv["kv_connector_extra_config"]["maru_async_lod"] = True  # as typed by hand
    with _stops_vllm("unknown key 'maru_async_lod'.*did you mean 'maru_async_load'"):
        _resolve_vllm_config(model_dir, kv)


@pytest.mark.parametrize("knobs, words", [
    ({"token": "not-the-token"}, "set maru_token or maru_token_file to the cache's token"),
    ({"cache_name": "c2"}, "set maru_cache_name to the name of the cache this sidecar serves"),
    ({"index_url": "tcp://127.0.0.1:1"}, "remove maru_index_url .* or make the two agree"),
], ids=["wrong-token", "wrong-cache", "other-index"])
def test_what_the_sidecar_refuses_stops_vllm_before_the_model_loads(model_dir, index, sidecar, knobs, words):
    kv = _sidecar_config(sidecar, **({} if "token" in knobs else {"token_file": index.token_file}), **knobs)
    with _stops_vllm(words):
        _resolve_vllm_config(model_dir, kv)


def test_without_cuda_graphs_vllm_0_32_is_stopped_before_it_sizes_the_kv_cache(model_dir, index, sidecar):
    """vLLM 0.32 with CUDA graphs off (the CPU build, ``--enforce-eager``) asks the
    connector's class first for its KV cache layout, right after loading the
    weights and before profiling and sizing the KV cache (``EngineCore._initialize_kv_caches``)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    config = _resolve_vllm_config(model_dir, _sidecar_config(sidecar, token_file=index.token_file))
    assert config.kv_transfer_config is not None
    extra = config.kv_transfer_config.kv_connector_extra_config
    del extra["maru_token_file"]
    extra["maru_token"] = "not-the-token"
    with pytest.raises(MaruConfigError, match="refused the hand-off.*set maru_token or maru_token_file"):
        get_kv_connector_cache_layout(config)


def test_an_unreadable_token_file_stops_vllm_before_the_model_loads(model_dir, sidecar, tmp_path):
    kv = _sidecar_config(sidecar, token_file=str(tmp_path / "no-such-token"))
    with _stops_vllm("maru_token_file=.*cannot be read"):
        _resolve_vllm_config(model_dir, kv)


def test_a_sidecar_not_up_yet_is_no_error(tmp_path, monkeypatch):
    """The containers of a pod start in any order: the connector asks again when it starts."""
    monkeypatch.setattr("maru_connector.preflight.SIDECAR_WAIT_S", 0.3)
    kv = make_kv_transfer_config(None, sidecar_socket=str(tmp_path / "later.sock"), cache_name=CACHE)
    checked = check_before_load(kv["kv_connector_extra_config"])
    assert checked.index_url is None and checked.pool is None


def test_a_sidecar_not_up_yet_with_its_pod_credential_is_no_error(tmp_path, monkeypatch):
    """The token file is the pod credential the sidecar writes at start: neither exists yet."""
    monkeypatch.setattr("maru_connector.preflight.SIDECAR_WAIT_S", 0.3)
    monkeypatch.setattr("maru_connector.config.TOKEN_FILE_WAIT_S", 0.3)
    kv = make_kv_transfer_config(None, sidecar_socket=str(tmp_path / "later.sock"), cache_name=CACHE,
                                 token_file=str(tmp_path / "credential"))
    checked = check_before_load(kv["kv_connector_extra_config"])
    assert checked.index_url is None and checked.pool is None


def test_the_index_address_comes_from_the_sidecar_s_hand_off(index, sidecar):
    """Without maru_index_url the worker's clients and the scheduler's lookup use
    the index the sidecar names: a store and a lookup round-trip through it."""
    raw = _sidecar_config(sidecar, token_file=index.token_file, kv_chunk_tokens=32, prefault_pool=False)
    extra = raw["kv_connector_extra_config"]
    assert "maru_index_url" not in extra
    cfg = parse_config(extra, BLOCK)
    checked = check_before_load(extra)
    assert checked.index_url == index.url
    assert f"index {index.url} (the sidecar's)" in startup_line("worker", checked)
    res = open_resources(cfg, make_kv_caches("cpu", layers=2, blocks=8, heads=2, block_size=BLOCK, head_size=8),
                         BLOCK)
    client = res.client_factory("store")
    key, length = b"h" * 16, 3000
    try:
        [slot] = client.reserve([(key, length)])
        res.pool.view(slot.offset, length)[:] = b"x" * length
        res.pool.write_slot_header(slot.offset, SlotHeader(key=key, generation=slot.generation, length=length))
        assert client.commit([key]) == [True]
    finally:
        client.close()
        res.close()
    lookup = _make_lookup(cfg)
    try:
        assert lookup.match("r", [[key]]) == 1
    finally:
        lookup.close()


def test_an_explicit_index_url_must_agree_with_the_sidecar_s(index, sidecar):
    """Spelled alike once parsed (the operator writes both from one value); otherwise refused."""
    agreeing = _sidecar_config(sidecar, token_file=index.token_file, index_url=index.url)
    assert check_before_load(agreeing["kv_connector_extra_config"]).index_url == index.url
    other = _sidecar_config(sidecar, token_file=index.token_file, index_url="unix:///run/other-index.sock")
    cfg = parse_config(other["kv_connector_extra_config"], BLOCK)
    with pytest.raises(MaruConfigError, match="differs from the index the sidecar"):
        open_resources(cfg, make_kv_caches("cpu", layers=2, blocks=8, heads=2, block_size=BLOCK, head_size=8),
                       BLOCK)


def test_without_a_sidecar_the_index_url_is_still_required(tmp_path: Path):
    with pytest.raises(MaruConfigError, match="needs 'maru_index_url'.*only with maru_sidecar_socket"):
        parse_config({"maru_pool_path": str(tmp_path / "pool")})
