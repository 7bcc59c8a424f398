"""Object sizes and layer extents of the chunkwise and layerwise formats."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_builders import make_kv_caches
from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_core.storage_format import StorageFormat

LAYOUT = detect_kv_layout(
    make_kv_caches("cpu", layers=4, blocks=8, heads=2, block_size=16, head_size=8)
)
BLOCK = 2 * 16 * 16 * 2  # heads * tokens * (K+V) * bf16


def test_chunkwise_sizes_and_extents():
    fmt = ObjectFormat(LAYOUT, chunk_tokens=64, storage=StorageFormat.CHUNKWISE)
    assert fmt.name == "chunkwise"
    assert fmt.blocks_per_chunk == 4
    assert fmt.layer_bytes == 4 * BLOCK
    assert fmt.objects_per_chunk == 1
    assert fmt.object_bytes == 4 * 4 * BLOCK
    assert [fmt.layer_extent(i) for i in range(4)] == [
        (i * 4 * BLOCK, 4 * BLOCK) for i in range(4)
    ]
    assert fmt.layer_source((1000,), 2) == 1000 + 2 * 4 * BLOCK


def test_layerwise_sizes_and_extents():
    fmt = ObjectFormat(LAYOUT, chunk_tokens=32, storage=StorageFormat.LAYERWISE)
    assert fmt.name == "layerwise"
    assert fmt.objects_per_chunk == 4
    assert fmt.object_bytes == 2 * BLOCK
    assert fmt.chunk_bytes == 4 * 2 * BLOCK
    assert all(fmt.layer_extent(i) == (0, 2 * BLOCK) for i in range(4))
    assert fmt.layer_source((10, 20, 30, 40), 2) == 30


@pytest.mark.parametrize("tokens", [0, -16, 24, 100])
def test_chunk_tokens_must_be_a_multiple_of_the_block_size(tokens):
    with pytest.raises(ValueError, match="multiple of the KV cache block size 16"):
        ObjectFormat(LAYOUT, chunk_tokens=tokens, storage=StorageFormat.CHUNKWISE)


@pytest.mark.parametrize("layerwise", [False, True])
def test_layer_out_of_range(layerwise):
    fmt = ObjectFormat(LAYOUT, chunk_tokens=16, storage=StorageFormat.LAYERWISE if layerwise else StorageFormat.CHUNKWISE)
    for bad in (-1, 4):
        with pytest.raises(IndexError):
            fmt.layer_extent(bad)


@settings(max_examples=50, deadline=None)
@given(blocks=st.integers(1, 8), layerwise=st.booleans())
def test_extents_tile_the_chunk_exactly(blocks, layerwise):
    fmt = ObjectFormat(LAYOUT, chunk_tokens=16 * blocks, storage=StorageFormat.LAYERWISE if layerwise else StorageFormat.CHUNKWISE)
    covered = []
    for layer in range(fmt.num_layers):
        offset, length = fmt.layer_extent(layer)
        assert length == blocks * LAYOUT.block_bytes_per_layer
        assert offset + length <= fmt.object_bytes
        if not layerwise:
            covered.append((offset, offset + length))
    if not layerwise:
        covered.sort()
        assert covered[0][0] == 0 and covered[-1][1] == fmt.object_bytes
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert fmt.objects_per_chunk * fmt.object_bytes == fmt.chunk_bytes
