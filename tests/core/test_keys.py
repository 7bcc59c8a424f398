"""Keys: determinism, namespace isolation, layer keys, the prefix property, stability across processes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maru_core.keys import (
    KEY_BYTES,
    KeyNamespace,
    block_alias_keys,
    chunk_keys,
    chunk_keys_of_namespaces,
    layer_key,
    layer_keys,
    object_layer_keys,
    packed_layer_keys,
    split_keys,
)

NS = KeyNamespace(
    model="tiny-llama",
    revision="abc123",
    dtype="bfloat16",
    kv_dtype="bfloat16",
    layout="cpu:(blocks,heads,block,2*head)",
    block_size=16,
    chunk_tokens=32,
    fmt="chunkwise",
    tp_rank=0,
    tp_size=2,
    cache_salt="",
    lora="",
)
TOKENS = list(range(1000, 1000 + 32 * 5 + 7))  # five full chunks and a partial one

# A different value for every field, each still valid with the others of NS.
CHANGED = {
    "model": "other-model",
    "revision": "def456",
    "weights": "0f" * 16,
    "model_config": "1e" * 16,
    "quantization": "fp8",
    "dtype": "float16",
    "kv_dtype": "fp8_e4m3",
    "kv_spec": "FullAttentionSpec:heads=8,head=128",
    "layout": "cuda:(2,blocks,block,heads,head)",
    "block_size": 32,
    "chunk_tokens": 64,
    "fmt": "layerwise",
    "tp_rank": 1,
    "tp_size": 4,
    "parallel": "dcp=2",
    "cache_salt": "user-42",
    "lora": "adapter-a",
}


def test_every_field_is_covered_by_the_changes() -> None:
    assert set(CHANGED) == {f.name for f in dataclasses.fields(KeyNamespace)}


def test_keys_are_16_bytes_one_per_full_chunk() -> None:
    keys = chunk_keys(NS, TOKENS)
    assert len(keys) == 5
    assert all(type(k) is bytes and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 5
    assert chunk_keys(NS, TOKENS[:31]) == []


def test_keys_are_deterministic() -> None:
    assert chunk_keys(NS, TOKENS) == chunk_keys(NS, list(TOKENS))
    assert chunk_keys(NS, tuple(TOKENS)) == chunk_keys(NS, TOKENS)
    assert NS.digest() == dataclasses.replace(NS).digest()


def test_the_documented_derivation() -> None:
    """key[i] = blake2b(key[i-1] || chunk i as little-endian int32, digest_size=16), key[-1] = ns.digest()."""
    prev = NS.digest()
    expected = []
    for c in range(5):
        chunk = b"".join(t.to_bytes(4, "little") for t in TOKENS[32 * c : 32 * (c + 1)])
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        expected.append(prev)
    assert chunk_keys(NS, TOKENS) == expected


def test_extras_change_their_chunk_and_every_later_key() -> None:
    """Two prompts with the same placeholder tokens but other images get other keys."""
    plain = chunk_keys(NS, TOKENS)
    image_a = chunk_keys(NS, TOKENS, [None, b"mm:a", None])
    image_b = chunk_keys(NS, TOKENS, [None, b"mm:b", None])
    assert image_a[0] == plain[0] and image_a[0] == image_b[0]
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain[1:], image_a[1:], image_b[1:]))
    assert chunk_keys(NS, TOKENS, [None] * 5) == plain  # no extras, the plain keys
    # The documented derivation: the extras follow the chunk's fixed-length token bytes.
    chunk1 = b"".join(t.to_bytes(4, "little") for t in TOKENS[32:64])
    assert image_a[1] == hashlib.blake2b(plain[0] + chunk1 + b"mm:a", digest_size=16).digest()
    with pytest.raises(ValueError, match="extras"):
        chunk_keys(NS, TOKENS, [b""])


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_every_namespace_field_changes_every_key(field: str) -> None:
    other = dataclasses.replace(NS, **{field: CHANGED[field]})
    assert other.digest() != NS.digest()
    mine = chunk_keys(NS, TOKENS)
    theirs = chunk_keys(other, TOKENS)
    # A changed chunk size changes the chunking too; compare whatever keys both have.
    assert theirs and not set(mine) & set(theirs)


def test_one_token_changes_its_chunk_and_every_later_key() -> None:
    changed = list(TOKENS)
    changed[32 * 2 + 5] += 1
    a, b = chunk_keys(NS, TOKENS), chunk_keys(NS, changed)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=32 * 6), cut=st.integers(0, 6))
def test_prefix_property(tokens: list[int], cut: int) -> None:
    """The keys of a prompt's first n chunks equal the keys of its prefix of n chunks."""
    full = chunk_keys(NS, tokens)
    n = min(cut, len(full))
    assert chunk_keys(NS, tokens[: n * NS.chunk_tokens]) == full[:n]
    assert chunk_keys(NS, tokens[: n * NS.chunk_tokens + 3])[:n] == full[:n]


def test_keys_of_several_namespaces_are_each_namespace_s_keys() -> None:
    ranks = [dataclasses.replace(NS, tp_rank=r) for r in range(2)]
    extras = [None, b"image-hash"]
    got = chunk_keys_of_namespaces(ranks, TOKENS, extras)
    assert got == [chunk_keys(ns, TOKENS, extras) for ns in ranks]
    assert got[0] != got[1]


def test_layer_keys_differ_per_layer_and_from_the_chunk_key() -> None:
    chunk = chunk_keys(NS, TOKENS)[0]
    keys = layer_keys(chunk, range(80))
    assert len(set(keys)) == 80
    assert chunk not in keys
    assert all(len(k) == KEY_BYTES for k in keys)
    assert layer_key(chunk, 7) == keys[7]
    other_chunk = chunk_keys(NS, TOKENS)[1]
    assert not set(keys) & set(layer_keys(other_chunk, range(80)))


def test_layer_keys_follow_the_true_layer_index_not_the_order_asked() -> None:
    chunk = chunk_keys(NS, TOKENS)[0]
    assert layer_keys(chunk, [3, 1, 2]) == [layer_key(chunk, 3), layer_key(chunk, 1), layer_key(chunk, 2)]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"chunk_tokens": 24}, "multiple of block_size"),
        ({"block_size": 0}, "positive"),
        ({"fmt": "blockwise"}, "fmt must be one of"),
        ({"tp_rank": 2}, "tp_rank"),
        ({"model": ""}, "model"),
        ({"block_size": True}, "must be int"),
        ({"dtype": None}, "must be str"),
    ],
)
def test_bad_namespace_fields_are_refused_by_name(changes: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        dataclasses.replace(NS, **changes)


@pytest.mark.parametrize("tokens, error", [([1, -1], ValueError), ([2**31], ValueError), ([1.5], TypeError)])
def test_bad_token_ids_are_refused(tokens: list, error: type) -> None:
    with pytest.raises(error):
        chunk_keys(NS, tokens * 32)


def test_layer_key_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        layer_key(b"short", 0)
    with pytest.raises(ValueError, match="layer"):
        layer_key(b"k" * 16, -1)
    with pytest.raises(ValueError, match="16 bytes"):
        object_layer_keys([b"k" * 16, b"short"], [0])
    with pytest.raises(ValueError, match="layer"):
        object_layer_keys([b"k" * 16], [0, 2**32])


@settings(max_examples=50, deadline=None)
@given(chunks=st.lists(st.binary(min_size=16, max_size=16), max_size=5),
       layers=st.lists(st.integers(0, 2**32 - 1), max_size=6))
def test_object_layer_keys_are_layer_key_chunk_major(chunks: list[bytes], layers: list[int]) -> None:
    assert object_layer_keys(chunks, layers) == [layer_key(c, layer) for c in chunks for layer in layers]


def test_a_layer_key_is_the_chunk_key_xor_the_layers_digest() -> None:
    chunk = chunk_keys(NS, TOKENS)[0]
    mask = hashlib.blake2b((7).to_bytes(4, "little"), digest_size=16, person=b"maru.layer").digest()
    assert layer_key(chunk, 7) == bytes(a ^ b for a, b in zip(chunk, mask))


@settings(max_examples=50, deadline=None)
@given(chunks=st.lists(st.binary(min_size=16, max_size=16), max_size=5),
       layers=st.lists(st.integers(0, 2**32 - 1), max_size=6))
def test_packed_layer_keys_are_object_layer_keys_end_to_end(chunks: list[bytes], layers: list[int]) -> None:
    packed = packed_layer_keys(chunks, layers)
    assert packed == b"".join(object_layer_keys(chunks, layers))
    assert packed_layer_keys(b"".join(chunks), layers) == packed  # chunk keys packed too
    assert split_keys(packed) == object_layer_keys(chunks, layers)


def test_packed_chunk_keys_must_be_whole_keys() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        packed_layer_keys(b"k" * 17, [0])


_CHILD = """
import json, sys
from maru_core.keys import KeyNamespace, chunk_keys, layer_key
ns = KeyNamespace(**json.loads(sys.argv[1]))
keys = chunk_keys(ns, json.loads(sys.argv[2]))
print(json.dumps([k.hex() for k in keys] + [layer_key(keys[0], 5).hex(), str(hash(b"x"))]))
"""


def _keys_in_child(seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(dataclasses.asdict(NS)), json.dumps(TOKENS)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return json.loads(out)


def test_same_keys_in_processes_with_different_hash_seeds() -> None:
    first, second = _keys_in_child("1"), _keys_in_child("2")
    # The seeds really differ (Python's hash() changed) ...
    assert first[-1] != second[-1]
    # ... and the keys do not, in either child or here.
    here = [k.hex() for k in chunk_keys(NS, TOKENS)] + [layer_key(chunk_keys(NS, TOKENS)[0], 5).hex()]
    assert first[:-1] == second[:-1] == here


# ---- block aliases: the prefix up to block j of a chunk

WIDE = dataclasses.replace(NS, chunk_tokens=64)  # four blocks of 16 per chunk


def test_block_aliases_follow_the_documented_derivation() -> None:
    """alias[j-1] = blake2b(previous chunk key || the chunk's first j blocks, person "maru.blocks")."""
    keys = chunk_keys(WIDE, TOKENS)
    chunk = TOKENS[64:128]
    aliases = block_alias_keys(WIDE, keys[0], chunk, 3)
    for j, alias in enumerate(aliases, start=1):
        data = b"".join(t.to_bytes(4, "little") for t in chunk[: 16 * j])
        assert alias == hashlib.blake2b(keys[0] + data, digest_size=16, person=b"maru.blocks").digest()
    first = block_alias_keys(WIDE, None, TOKENS[:64], 1)  # chunk 0 hangs off the namespace digest
    assert first == block_alias_keys(WIDE, WIDE.digest(), TOKENS[:64], 1)


def test_a_block_alias_names_only_its_prefix_and_never_equals_a_key() -> None:
    keys = chunk_keys(WIDE, TOKENS)
    diverged = TOKENS[:64] + TOKENS[64:96] + [7] * 32  # shares chunk 1's first two blocks only
    ours = block_alias_keys(WIDE, keys[0], TOKENS[64:128], 3)
    theirs = block_alias_keys(WIDE, chunk_keys(WIDE, diverged)[0], diverged[64:128], 3)
    assert ours[:2] == theirs[:2] and ours[2] != theirs[2]
    assert len(set(ours)) == 3 and not set(ours) & set(keys)
    assert chunk_keys(WIDE, diverged)[1] != keys[1]  # the chunk keys cannot say what the aliases do
    other_prev = block_alias_keys(WIDE, keys[1], TOKENS[64:128], 3)  # the prefix before the chunk counts
    assert not set(other_prev) & set(ours)


@pytest.mark.parametrize("prev, tokens, max_blocks, message", [
    (None, TOKENS[:64], 4, "max_blocks must be in"),  # a whole chunk is the chunk key
    (None, TOKENS[:40], 3, "max_blocks must be in"),  # only two whole blocks given
    (None, TOKENS[:64], -1, "max_blocks must be in"),
    (b"short", TOKENS[:64], 1, "prev must be 16 bytes"),
])
def test_block_alias_keys_check_their_arguments(prev, tokens, max_blocks, message) -> None:
    with pytest.raises(ValueError, match=message):
        block_alias_keys(WIDE, prev, tokens, max_blocks)
