"""Identity: what goes into keys, and what is refused at start-up.

The engine's configuration is vLLM's own types where they are cheap to build
(KV cache specs, requests, LoRA and multimodal descriptors); the engine
config around them is a plain namespace holding what the connector reads.
"""

from __future__ import annotations

import os
import shutil
import time
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
from maru_connector import identity
from maru_connector.identity import (
    AdapterIdentities,
    AdapterUnreadable,
    base_namespaces,
    check_engine_supported,
    request_is_cacheable,
    request_keys,
    weights_fingerprint,
)
from maru_tools.tiny_model import TinyModelSpec, build_tiny_model

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


def _adapter(path, weights: bytes, rank=8):
    """A PEFT adapter's files: what vLLM reads from ``lora_path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(f'{{"r": {rank}, "lora_alpha": 16}}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def _age(path, seconds=60):
    """Date the adapter's files back, as files written before the engine started are."""
    for f in path.iterdir():
        stamp = time.time() - seconds
        os.utime(f, (stamp, stamp))


def _lora_keys(ns, path, adapters=None, name="sql", int_id=1, **kwargs):
    request = _request(f"r{time.monotonic_ns()}", range(64),
                       lora_request=LoRARequest(name, int_id, str(path), **kwargs))
    return set(request_keys(ns, request, adapters).by_rank[0])


def test_a_lora_name_re_pointed_at_another_adapter_gets_other_keys(models, tmp_path):
    ns = _namespaces(models)
    v1 = _lora_keys(ns, _adapter(tmp_path / "sql-v1", b"v1" * 100))
    v2 = _lora_keys(ns, _adapter(tmp_path / "sql-v2", b"v2" * 100))
    assert not v1 & v2


def test_adapters_of_one_name_and_path_are_told_apart_by_their_bytes(models, tmp_path):
    """Two pods mount other weights at the same path (here: one path, rewritten
    between two engines): other bytes, other keys; the same bytes elsewhere under
    another name, the same keys."""
    ns = _namespaces(models)
    path = _adapter(tmp_path / "sql", b"a" * 4096)
    pod_a = _lora_keys(ns, path)
    _adapter(path, b"b" * 4096)  # same name, path and size
    pod_b = _lora_keys(ns, path)
    assert not pod_a & pod_b
    copy = shutil.copytree(path, tmp_path / "elsewhere" / "other-name")
    assert _lora_keys(ns, copy, name="other-name", int_id=7) == pod_b
    assert _lora_keys(ns, path) == pod_b


def test_an_adapter_changed_in_place_gets_new_keys_once_reloaded(models, tmp_path):
    """vLLM keeps an adapter loaded under its id: files changed under it give no
    keys until a request reloads it (``load_inplace``) or it comes under a new id."""
    ns = _namespaces(models)
    adapters = AdapterIdentities()
    path = _adapter(tmp_path / "sql", b"old" * 1000)
    old = _lora_keys(ns, path, adapters)
    assert _lora_keys(ns, path, adapters) == old
    _adapter(path, b"new" * 1000)
    with pytest.raises(AdapterUnreadable, match="changed since adapter id 1 was loaded"):
        _lora_keys(ns, path, adapters)
    reloaded = _lora_keys(ns, path, adapters, load_inplace=True)
    assert not reloaded & old
    assert _lora_keys(ns, path, adapters) == reloaded
    assert _lora_keys(ns, path, AdapterIdentities(), int_id=2) == reloaded  # a restarted engine


def test_an_adapter_is_hashed_once_until_a_file_changes(models, tmp_path, monkeypatch):
    ns = _namespaces(models)
    path = _adapter(tmp_path / "sql", b"w" * 10000)
    _age(path)
    hashed = []
    real = identity._fingerprint_of_files
    monkeypatch.setattr(identity, "_fingerprint_of_files", lambda *a: hashed.append(a) or real(*a))
    adapters = AdapterIdentities()
    first = _lora_keys(ns, path, adapters)
    for _ in range(5):
        assert _lora_keys(ns, path, adapters) == first
    assert len(hashed) == 1
    _adapter(path, b"x" * 10000)  # just written: hashed at every request until it is older
    assert _lora_keys(ns, path, AdapterIdentities()) != first
    assert _lora_keys(ns, path, AdapterIdentities()) != first
    assert len(hashed) == 3


def test_an_unreadable_adapter_gives_no_keys_and_one_warning(models, tmp_path, caplog):
    ns = _namespaces(models)
    adapters = AdapterIdentities()
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, why in ((tmp_path / "missing", "is no directory here"), (empty, "holds no weight file")):
        with caplog.at_level("WARNING", logger="vllm.maru_connector.identity"):
            for _ in range(3):
                with pytest.raises(AdapterUnreadable, match=why):
                    _lora_keys(ns, path, adapters)
        assert len([r for r in caplog.records if why in r.getMessage()]) == 1


def test_requests_whose_kv_cannot_be_keyed_are_not_cacheable():
    assert request_is_cacheable(_request("a", range(64))) == (True, "")
    no_hash = SimpleNamespace(prompt_token_ids=[1, 2], mm_features=[SimpleNamespace(identifier=None)])
    assert request_is_cacheable(no_hash) == (False, "a multimodal input has no hash")
    embeds_only = Request("e", None, SamplingParams(max_tokens=1), None, prompt_embeds=torch.zeros(64, 8))
    assert request_is_cacheable(embeds_only) == (False, "the prompt has no token ids")


def test_a_request_whose_adapter_cannot_be_read_is_neither_looked_up_nor_stored(models, tmp_path):
    """The scheduler half with an index that counts its calls: the request with
    an unreadable adapter asks nothing and stores nothing; one beside it with a
    readable adapter does both."""
    from fake_index import FakeIndex
    from test_scheduler import Geometry, make_half, step_output

    index = FakeIndex(Geometry())
    half = make_half(index)
    tokens = list(range(1, 101))
    lost = _request("lost", tokens, lora_request=LoRARequest("sql", 1, str(tmp_path / "missing")))
    assert half.get_num_new_matched_tokens(lost, 0) == (0, False)
    assert sum(index.calls.values()) == 0
    stores = half.build_connector_meta(step_output({"lost": 100}, {"lost": list(range(7))})).stores
    assert stores == []
    found = _request("found", tokens, lora_request=LoRARequest("sql", 1, str(_adapter(tmp_path / "sql", b"s" * 64))))
    assert half.get_num_new_matched_tokens(found, 0) == (0, False)
    assert index.calls["match_prefix"] + index.calls["retrieve_prefix"] == 1
    stores = half.build_connector_meta(step_output({"found": 100}, {"found": list(range(7))})).stores
    assert [s.req_id for s in stores] == ["found"]


def test_requests_running_when_their_adapter_is_reloaded_with_other_weights_store_nothing_more(models, tmp_path):
    """vLLM swaps the weights under the requests of that adapter id already
    running: what they compute next is the new weights' KV under the old keys."""
    from fake_index import FakeIndex
    from test_scheduler import Geometry, make_half, step_output

    half = make_half(FakeIndex(Geometry()))
    path = _adapter(tmp_path / "sql", b"old" * 100)
    tokens = list(range(1, 101))
    running = _request("running", tokens, lora_request=LoRARequest("sql", 1, str(path)))
    half.get_num_new_matched_tokens(running, 0)
    _adapter(path, b"new" * 100)
    reloading = _request("reloading", tokens, lora_request=LoRARequest("sql", 1, str(path), load_inplace=True))
    half.get_num_new_matched_tokens(reloading, 0)
    scheduled = {"running": 64, "reloading": 64}
    stores = half.build_connector_meta(step_output(scheduled, {r: list(range(7)) for r in scheduled})).stores
    assert [s.req_id for s in stores] == ["reloading"]
