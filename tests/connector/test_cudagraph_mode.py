"""vLLM's own config resolution never keeps a FULL CUDA graph over a load that may still be landing.

A FULL graph replays attention without calling ``wait_for_layer_load``, so a
forward overlapped with a load would read blocks still being written. The
connector asks vLLM for PIECEWISE graphs whenever loads overlap the forward
(``requires_piecewise_for_cudagraph``); vLLM applies it while resolving its
config. That resolution only runs on platforms with static graphs (CUDA), so
the test presents the CPU platform as one; the GPU half of the guarantee (the
waits between captured pieces) is tested on the GPU.
"""

from __future__ import annotations

from unittest import mock

import pytest
from vllm.config import CompilationConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.platforms import current_platform

from maru_connector.config import make_kv_transfer_config
from maru_connector.connector import MaruKVConnector
from maru_tools.tiny_model import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def model_dir():
    return str(build_tiny_model(TinyModelSpec(num_layers=2, seed=0)))


def _resolved_mode(model_dir, **knobs):
    kv = make_kv_transfer_config("tcp://127.0.0.1:1", pool_path="/dev/shm/unused", **knobs)
    seen = []
    real = MaruKVConnector.requires_piecewise_for_cudagraph.__func__

    def spy(cls, extra):
        seen.append(real(cls, extra))
        return seen[-1]

    platform = type(current_platform)
    with mock.patch.object(platform, "support_static_graph_mode", classmethod(lambda cls: True)), \
            mock.patch.object(MaruKVConnector, "requires_piecewise_for_cudagraph", classmethod(spy)), \
            mock.patch.object(platform, "check_and_update_config", classmethod(lambda cls, cfg: None)):
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, tokenizer=model_dir, dtype="float32",
                                     skip_tokenizer_init=True),
            kv_transfer_config=KVTransferConfig(**kv),
            compilation_config=CompilationConfig(cudagraph_mode="FULL"),
        )
    assert seen, "vLLM never asked the connector"
    return config.compilation_config.cudagraph_mode


@pytest.mark.parametrize("knobs", [
    {"overlap_load_with_compute": True},
    {"async_load": True, "overlap_load_with_compute": True},
    {"async_load": True, "overlap_load_with_compute": True, "use_layerwise": True},
], ids=["sync-overlap", "async-overlap", "async-overlap-layerwise"])
def test_overlapped_loads_get_piecewise_graphs(model_dir, knobs):
    mode = _resolved_mode(model_dir, **knobs)
    assert not mode.has_full_cudagraphs(), mode


@pytest.mark.parametrize("knobs", [{}, {"async_load": True}], ids=["sync", "async-whole"])
def test_loads_that_land_before_the_forward_keep_full_graphs(model_dir, knobs):
    # Without overlap every layer has landed before a forward runs over it.
    assert _resolved_mode(model_dir, **knobs).has_full_cudagraphs()


def test_a_bad_knob_fails_config_resolution(model_dir):
    with pytest.raises(ValueError, match="maru_overlap_load_with_compute"):
        _resolved_mode(model_dir, overlap_load_with_compute="yes")
