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


# ------------------------------------------------------------- strategies
def test_every_storage_format_has_one_strategy_that_names_it():
    from maru_core.pool.slots import SlotFormat

    from maru_connector.formats import STRATEGIES, configured_format, strategy_for

    assert set(STRATEGIES) == set(StorageFormat)
    for storage, strategy in STRATEGIES.items():
        assert strategy.storage is storage and strategy_for(storage) is strategy
        assert strategy.slot_format is SlotFormat[storage.name]
        fmt = ObjectFormat(LAYOUT, chunk_tokens=32, storage=storage)
        assert fmt.strategy is strategy and fmt.name == storage.value

    class Knobs:
        fmt_name = "layerwise"

    assert configured_format(Knobs()) is StorageFormat.LAYERWISE


def test_a_layerwise_flag_still_reads_as_its_format_and_a_bad_format_is_refused():
    assert ObjectFormat(LAYOUT, 32, True).storage is StorageFormat.LAYERWISE
    assert ObjectFormat(LAYOUT, 32, False).storage is StorageFormat.CHUNKWISE
    assert ObjectFormat(LAYOUT, 32, "layerwise").storage is StorageFormat.LAYERWISE
    with pytest.raises(ValueError, match="unknown storage format 'rowwise'"):
        ObjectFormat(LAYOUT, 32, "rowwise")


def test_the_strategies_pack_the_keys_the_index_stores():
    from maru_core.keys import packed_layer_keys

    keys = [bytes([i]) * 16 for i in range(3)]
    layers = (0, 1, 2, 3)
    chunkwise = ObjectFormat(LAYOUT, 32, StorageFormat.CHUNKWISE).strategy
    layerwise = ObjectFormat(LAYOUT, 32, StorageFormat.LAYERWISE).strategy
    assert chunkwise.object_keys(keys, layers) == b"".join(keys)
    assert layerwise.object_keys(keys, layers) == packed_layer_keys(keys, layers)
    with pytest.raises(ValueError, match="16 bytes each"):
        chunkwise.object_keys([b"short"], layers)


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 4), layerwise=st.booleans(), chunks=st.integers(0, 5), data=st.data())
def test_what_the_strategy_derives_is_each_format_s_closed_form(blocks, layerwise, chunks, data):
    """The answers the connector used to spell out per format, derived now from
    the strategy's placement of each layer."""
    from maru_connector.transfer.checks import describe, objects_due, piece_of

    storage = StorageFormat.LAYERWISE if layerwise else StorageFormat.CHUNKWISE
    fmt = ObjectFormat(LAYOUT, chunk_tokens=16 * blocks, storage=storage)
    nl, row = fmt.num_layers, fmt.layer_bytes
    assert fmt.objects_per_chunk == (nl if layerwise else 1)
    assert fmt.object_bytes == (row if layerwise else row * nl)
    sources = tuple(data.draw(st.lists(st.integers(0, 1 << 30), min_size=fmt.objects_per_chunk,
                                       max_size=fmt.objects_per_chunk)))
    for layer in range(nl):
        assert fmt.layer_extent(layer) == ((0, row) if layerwise else (layer * row, row))
        assert fmt.layer_source(sources, layer) == (sources[layer] if layerwise else sources[0] + layer * row)
        for chunk in range(chunks):
            assert piece_of(fmt, chunk, layer) == ((chunk * nl + layer, 0) if layerwise
                                                   else (chunk, layer * row // 4))
        want = ([c * nl + layer for c in range(chunks)] if layerwise
                else list(range(chunks)) if layer == nl - 1 else [])
        due = objects_due(fmt, chunks, layer)
        assert due.dtype.kind == "i" and due.tolist() == want
    for obj in range(chunks * fmt.objects_per_chunk):
        assert describe(fmt, obj) == (
            f"the object of chunk {obj // nl}, layer {obj % nl} of the load" if layerwise
            else f"the object of chunk {obj} of the load")
