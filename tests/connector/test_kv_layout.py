"""KV cache layout detection: every supported layout, true layer order, and
refusal of everything else."""

import pytest
import torch

from kv_builders import ALL_KINDS, block_bytes, layer_name, make_kv_caches
from maru_connector.kv_layout import (
    SUPPORTED_LAYOUTS,
    UnsupportedKVLayout,
    detect_kv_layout,
    parse_layer_index,
)


def test_builders_cover_every_supported_layout():
    assert set(ALL_KINDS) == set(SUPPORTED_LAYOUTS)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_detects_each_layout_and_its_geometry(kind):
    kv = make_kv_caches(kind, layers=3, blocks=7, heads=2, block_size=16, head_size=8)
    layout = detect_kv_layout(kv)
    assert layout.kind == kind
    assert (layout.num_blocks, layout.block_size) == (7, 16)
    assert (layout.num_kv_heads, layout.head_size) == (2, 8)
    assert layout.dtype == torch.bfloat16
    assert layout.block_bytes_per_layer == 2 * 16 * 2 * 8 * 2
    assert layout.layer_names == tuple(layer_name(i) for i in range(3))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_block_view_reads_exactly_each_logical_block(kind):
    kv = make_kv_caches(kind, layers=2, blocks=5, heads=3, block_size=4, head_size=6)
    layout = detect_kv_layout(kv)
    for name in layout.layer_names:
        view = layout.block_view(kv[name])
        for b in range(layout.num_blocks):
            got = view[b].contiguous().flatten()
            assert got.numel() == layout.block_bytes_per_layer
            # Same multiset of bytes as the logical block; same order for the
            # layouts whose block is stored in logical order.
            want = block_bytes(kind, kv[name], b)
            assert torch.equal(got.sort().values, want.sort().values)
            if kind in ("cpu", "flashinfer_nhd", "packed_blhnc", "flash_nhd"):
                assert torch.equal(got, want)


def test_vllm_allocator_views_for_every_vllm_layout():
    """Build the per-layer views with vLLM's own allocator code."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout as VllmLayout

    expected = {
        "LBHNC": "cpu", "LBNHC": "packed_lbnhc", "LHBNC": "packed_lhbnc",
        "BLHNC": "packed_blhnc", "BLNHC": "packed_blnhc", "BHLNC": "packed_bhlnc",
    }
    layers, blocks = 4, 6
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    for vllm_layout in VllmLayout:
        strides = compute_layout_strides(spec, blocks, layers, vllm_layout)
        names = [layer_name(i) for i in range(layers)]
        tensor = KVCacheTensor(size=layers * blocks * spec.page_size_bytes, layers=names,
                               layer_stride=strides[0], block_stride=strides[1])
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        views = create_kv_cache_views(raw, spec, blocks, vllm_layout, tensor)
        layout = detect_kv_layout(dict(zip(names, views)))
        assert layout.kind == expected[vllm_layout.name]
        assert layout.block_bytes_per_layer == spec.page_size_bytes
        assert layout.layer_stride_bytes == strides[0]


def test_layers_ordered_by_true_index_not_dict_order():
    kv = make_kv_caches("cpu", layers=12, shuffle=True)
    layout = detect_kv_layout(kv)
    assert layout.layer_names == tuple(layer_name(i) for i in range(12))
    assert layout.layer_indices == tuple(range(12))
    assert layout.position(layer_name(10)) == 10
    with pytest.raises(KeyError, match="unknown KV cache layer"):
        layout.position("model.layers.99.self_attn.attn")


def test_pipeline_stage_keeps_model_layer_indices():
    kv = make_kv_caches("cpu", layers=3, shuffle=False)
    renamed = {layer_name(i + 16): t for i, t in enumerate(kv.values())}
    layout = detect_kv_layout(renamed)
    assert layout.layer_indices == (16, 17, 18)
    assert layout.position(layer_name(17)) == 1


@pytest.mark.parametrize(
    "name,index",
    [
        ("model.layers.7.self_attn.attn", 7),
        ("language_model.model.layers.31.self_attn.attn", 31),
        ("transformer.h.5.attn.attn", 5),
        ("model.decoder.layers.0.self_attn.attn", 0),
        ("3.attn", 3),
    ],
)
def test_parse_layer_index(name, index):
    assert parse_layer_index(name) == index


@pytest.mark.parametrize("name", ["model.attn", "model.blocks.x.sub.1.attn.2"])
def test_layer_name_without_index_is_refused(name):
    with pytest.raises(UnsupportedKVLayout, match="layer index"):
        parse_layer_index(name)


def test_two_caches_for_one_layer_index_are_refused():
    t = make_kv_caches("cpu", layers=1, shuffle=False)[layer_name(0)]
    with pytest.raises(UnsupportedKVLayout, match="share layer index 0"):
        detect_kv_layout({"model.layers.0.self_attn.attn": t,
                          "model.layers.0.cross_attn.attn": t})


def _refused(tensor):
    with pytest.raises(UnsupportedKVLayout) as err:
        detect_kv_layout({layer_name(0): tensor})
    message = str(err.value)
    assert str(tuple(tensor.shape)) in message
    return message


def test_unknown_shapes_are_refused_naming_shape_strides_and_supported():
    message = _refused(torch.zeros(4, 16, 32))
    assert "strides (512, 32, 1)" in message
    for kind in SUPPORTED_LAYOUTS:
        assert kind in message
    _refused(torch.zeros(4, 2, 16, 15))          # odd content: not K|V
    _refused(torch.zeros(3, 4, 16, 2, 8))        # kv dimension of 3
    _refused(torch.zeros(2, 4, 16, 2, 8, 1))     # 6-D


def test_unknown_strides_are_refused():
    # Block dimension innermost-but-one: a permutation no backend uses.
    _refused(torch.zeros(16, 2, 4, 32).permute(2, 1, 0, 3))
    # Content not innermost.
    _refused(torch.zeros(4, 2, 32, 16).transpose(2, 3))
    # Padding between the tokens of a block.
    _refused(torch.zeros(4, 2, 20, 32)[:, :, :16, :])
    # kv-first with V before K in memory order mismatching the strides.
    _refused(torch.zeros(4, 16, 2, 8, 2).permute(4, 0, 1, 2, 3))


def test_ambiguous_tensor_is_refused():
    # With two blocks, (2, B, N, H, D) and (B, 2, N, H, D) have equal strides.
    with pytest.raises(UnsupportedKVLayout, match="ambiguous"):
        detect_kv_layout({layer_name(0): torch.zeros(2, 2, 16, 2, 8)})


def test_one_kv_head_is_the_cpu_layout_not_an_ambiguity():
    # vLLM's CPU cache with one KV head (a multi-query model, or one rank of
    # TP=2 over two KV heads) also fits the packed layouts, with the same bytes
    # per block: it is detected, not refused.
    caches = {layer_name(i): t for i, t in enumerate(torch.zeros(2, 1024, 1, 32, 128).unbind(0))}
    layout = detect_kv_layout(caches)
    assert (layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.head_size) == (1024, 1, 32, 64)
    assert layout.block_bytes_per_layer == 32 * 128 * 4


def test_layers_that_disagree_are_refused():
    a = make_kv_caches("cpu", layers=1, shuffle=False)[layer_name(0)]
    b = make_kv_caches("packed_lbnhc", layers=1, shuffle=False)[layer_name(0)]
    with pytest.raises(UnsupportedKVLayout, match="disagree"):
        detect_kv_layout({layer_name(0): a, layer_name(1): b})
    with pytest.raises(UnsupportedKVLayout, match="no KV cache tensors"):
        detect_kv_layout({})


def test_one_buffer_detected_separate_buffers_not():
    kv = make_kv_caches("cpu", layers=4, blocks=3, heads=2, block_size=16, head_size=8)
    assert detect_kv_layout(kv).layer_stride_bytes == 3 * 2 * 16 * 16 * 2
    separate = {layer_name(i): torch.zeros(3, 2, 16, 16) for i in range(4)}
    assert detect_kv_layout(separate).layer_stride_bytes is None


def test_kernel_blocks_are_grouped_into_scheduler_blocks():
    kv = make_kv_caches("cpu", layers=2, blocks=8, block_size=16)
    layout = detect_kv_layout(kv, block_size=64)
    assert (layout.num_blocks, layout.block_size) == (2, 64)
    assert layout.block_bytes_per_layer == 4 * detect_kv_layout(kv).block_bytes_per_layer
    t = kv[layer_name(0)]
    assert torch.equal(layout.block_view(t)[1].flatten(),
                       t[4:8].contiguous().view(torch.uint8).flatten())
    with pytest.raises(UnsupportedKVLayout, match="kernel block"):
        detect_kv_layout(kv, block_size=48)
    with pytest.raises(UnsupportedKVLayout, match="kernel block"):
        detect_kv_layout(make_kv_caches("flash_nhd", blocks=8), block_size=64)


def test_import_does_not_need_vllm():
    import subprocess
    import sys

    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name == 'vllm' or name.startswith('vllm.'):\n"
        "        raise ImportError('vllm must not be imported')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import maru_connector.kv_layout, maru_connector.object_format\n"
        "import maru_connector.transfer.cpu, maru_connector.transfer.cuda\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
