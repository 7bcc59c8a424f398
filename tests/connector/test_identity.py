"""Identity: what goes into keys, and what is refused at start-up.

The engine's configuration is vLLM's own types where they are cheap to build
(KV cache specs, requests, LoRA and multimodal descriptors); the engine
config around them is a plain namespace holding what the connector reads.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from maru_connector.config import MaruConfigError, parse_config
from maru_connector.identity import (
    base_namespaces,
    check_engine_supported,
    request_is_cacheable,
    request_keys,
    weights_fingerprint,
)
from maru_connector.testing.tiny_model import TinyModelSpec, build_tiny_model

BLOCK, CHUNK = 16, 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny models of one architecture and other weights, in a scratch dir."""
    root = tmp_path_factory.mktemp("models")
    a = shutil.copytree(build_tiny_model(TinyModelSpec(seed=0)), root / "a")
    b = shutil.copytree(build_tiny_model(TinyModelSpec(seed=1)), root / "b")
    return a, b


def full_spec(**changes):
    fields = dict(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return FullAttentionSpec(**{**fields, **changes})


def kv_config(spec=None):
    spec = spec or full_spec()
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])


def engine(model_dir, *, pp=1, tp=1, dcp=1, policy="recompute", quantization=None, window=None,
           hf_changes=None):
    """What the connector reads of vLLM's engine config."""
    hf = AutoConfig.from_pretrained(model_dir)
    for name, value in (hf_changes or {}).items():
        setattr(hf, name, value)
    model = SimpleNamespace(model=str(model_dir), revision=None, dtype=torch.bfloat16, hf_config=hf,
                            quantization=quantization, get_sliding_window=lambda: window)
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                        decode_context_parallel_size=dcp,
                                        prefill_context_parallel_size=1, cp_kv_cache_interleave_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_dtype_skip_layers=[]),
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy),
        attention_config=SimpleNamespace(backend=None),
    )


CFG = parse_config({"maru_index_url": "tcp://h:1", "maru_pool_path": "/p", "maru_kv_chunk_tokens": CHUNK}, BLOCK)


def digest(vllm_config, kv=None) -> bytes:
    return base_namespaces(vllm_config, kv or kv_config(), CFG)[0].digest()


# ---- start-up refusals ------------------------------------------------------------------------


def test_a_plain_full_attention_engine_is_accepted(models):
    check_engine_supported(engine(models[0], tp=2), kv_config())


@pytest.mark.parametrize(
    "changes, spec, message",
    [
        ({"pp": 2}, None, "pipeline parallelism"),
        ({"dcp": 2}, None, "context parallelism"),
        ({"policy": "fail"}, None, '"kv_load_failure_policy": "recompute"'),
        ({"window": 4096}, None, "sliding window 4096"),
        ({}, full_spec(sliding_window=128), "sliding window 128"),
        ({}, full_spec(attention_chunk_size=256), "chunked local attention 256"),
        ({}, SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                               sliding_window=64), "sliding window 64"),
    ],
    ids=["pipeline", "context-parallel", "fail-policy", "model-window", "spec-window", "chunked-local",
         "window-spec"],
)
def test_what_keys_cannot_make_safe_is_refused_at_start_up(models, changes, spec, message):
    with pytest.raises(MaruConfigError, match=message):
        check_engine_supported(engine(models[0], **changes), kv_config(spec))


# ---- model identity -----------------------------------------------------------------------------


def test_the_model_is_named_by_its_files_not_its_path(models, tmp_path):
    a, b = models
    same_files_elsewhere = shutil.copytree(a, tmp_path / "mounted-elsewhere")
    assert digest(engine(a)) == digest(engine(same_files_elsewhere))
    # Other weights at the very same path (a model updated in place, another pod's mount).
    swapped = shutil.copytree(a, tmp_path / "model")
    before = digest(engine(swapped))
    for weights in b.glob("*.safetensors"):
        shutil.copy(weights, swapped / weights.name)
    assert digest(engine(swapped)) != before


def test_the_fingerprint_samples_large_files_and_sees_a_change_in_the_middle(tmp_path):
    size = 64 << 20
    path = tmp_path / "model.safetensors"
    data = bytearray(size)
    path.write_bytes(data)
    first = weights_fingerprint(tmp_path)
    start = 1 << 20
    step = (size - 2 * (1 << 20)) // 32
    data[start + 5 * step + 7] = 1  # inside a sampled piece
    path.write_bytes(data)
    assert weights_fingerprint(tmp_path) != first
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    assert weights_fingerprint(no_weights) is None


@pytest.mark.parametrize(
    "changes",
    [
        {"quantization": "fp8"},
        {"hf_changes": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}},
        {"hf_changes": {"rope_theta": 500000.0}},
        {"dcp": 2},
    ],
    ids=["quantization", "rope-scaling", "rope-theta", "decode-context-parallel"],
)
def test_what_changes_the_kv_changes_the_namespace(models, changes):
    assert digest(engine(models[0], **changes)) != digest(engine(models[0]))


def test_fp8_kv_quantization_and_head_geometry_change_the_namespace(models):
    plain = digest(engine(models[0]))
    fp8 = full_spec(dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    assert digest(engine(models[0]), kv_config(fp8)) != plain
    assert digest(engine(models[0]), kv_config(full_spec(num_kv_heads=1, head_size=128))) != plain


# ---- per request ----------------------------------------------------------------------------------


def _namespaces(models):
    return base_namespaces(engine(models[0]), kv_config(), CFG)


def _request(req_id, tokens, **kwargs):
    return Request(req_id, list(tokens), SamplingParams(max_tokens=1), None, **kwargs)


def _image(identifier, offset, length=40):
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_images_behind_the_same_placeholder_tokens_get_other_keys(models):
    ns = _namespaces(models)
    tokens = [7] * 40 + [9] * 50 + list(range(100, 138))  # placeholders at 40..79: chunks 1 and 2
    cat = request_keys(ns, _request("cat", tokens, mm_features=[_image("cat-hash", 40)]))
    dog = request_keys(ns, _request("dog", tokens, mm_features=[_image("dog-hash", 40)]))
    text = request_keys(ns, _request("text", tokens))
    assert cat.num_chunks == dog.num_chunks == 4
    assert cat.by_rank[0][0] == dog.by_rank[0][0] == text.by_rank[0][0]  # before the image
    assert all(c != d for c, d in zip(cat.by_rank[0][1:], dog.by_rank[0][1:]))
    assert all(c != t for c, t in zip(cat.by_rank[0][1:], text.by_rank[0][1:]))
    again = request_keys(ns, _request("cat2", tokens, mm_features=[_image("cat-hash", 40)]))
    assert again == cat  # the same image at the same place: a hit


def test_prompt_embeddings_are_covered(models):
    ns = _namespaces(models)
    tokens = list(range(64))
    a = request_keys(ns, _request("a", tokens, prompt_embeds=torch.zeros(64, 8)))
    b = request_keys(ns, _request("b", tokens, prompt_embeds=torch.ones(64, 8)))
    assert not set(a.by_rank[0]) & set(b.by_rank[0])


def test_a_lora_name_re_pointed_at_another_adapter_gets_other_keys(models):
    ns = _namespaces(models)
    tokens = list(range(64))
    v1 = request_keys(ns, _request("a", tokens, lora_request=LoRARequest("sql", 1, "/adapters/sql-v1")))
    v2 = request_keys(ns, _request("b", tokens, lora_request=LoRARequest("sql", 1, "/adapters/sql-v2")))
    assert not set(v1.by_rank[0]) & set(v2.by_rank[0])


def test_requests_whose_kv_cannot_be_keyed_are_not_cacheable():
    assert request_is_cacheable(_request("a", range(64))) == (True, "")
    no_hash = SimpleNamespace(prompt_token_ids=[1, 2], mm_features=[SimpleNamespace(identifier=None)])
    assert request_is_cacheable(no_hash) == (False, "a multimodal input has no hash")
    embeds_only = Request("e", None, SamplingParams(max_tokens=1), None, prompt_embeds=torch.zeros(64, 8))
    assert request_is_cacheable(embeds_only) == (False, "the prompt has no token ids")
