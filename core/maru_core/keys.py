"""Object keys: the identity namespace, chunk keys and layer keys.

A key is 16 bytes, a blake2b digest. Chunk keys are a rolling hash over the
token ids, seeded with the digest of a ``KeyNamespace`` that binds everything
that makes KV bytes meaningful (model and weights, model config, quantization,
dtypes, layout, block and chunk size, format, tensor- and context-parallel
layout, cache salt, LoRA adapter). Two engines that differ in any of these
never share a key. What a chunk holds beyond token ids (multimodal inputs,
prompt embeddings) goes into that chunk's key as ``extras``.

This module is the one owner of the key format: any change to it changes
``KEY_FORMAT_VERSION``, which is hashed into every namespace digest, so keys
of two formats can never collide. Python's ``hash()`` is never used: it
changes from one process to the next.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import NewType

import msgpack
import numpy as np

from .storage_format import StorageFormat

Key = NewType("Key", bytes)

#: Bytes in a key.
KEY_BYTES = 16
#: Version of the key derivation below; hashed into every namespace digest.
#: 3: a layer key is the chunk key XOR a per-layer mask (was a blake2b of both).
KEY_FORMAT_VERSION = 3
#: Object formats: one object per chunk (all layers) or per (chunk, layer).
FORMATS = tuple(f.value for f in StorageFormat)

_NS_PERSON = b"maru.ns"
_LAYER_PERSON = b"maru.layer"
_BLOCKS_PERSON = b"maru.blocks"
_U32_MAX = 2**32 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyNamespace:
    """Everything that must match for two engines to share KV bytes.

    ``model`` and ``revision`` name the model; ``weights`` fingerprints its
    files (config and weights, so fp8 KV scales loaded from the checkpoint
    too); ``model_config`` digests the effective model configuration
    (overrides, rope scaling); ``quantization`` the weight quantization;
    ``dtype`` and ``kv_dtype`` the model and KV-cache dtypes (e.g.
    ``"bfloat16"``, ``"fp8_e4m3"``); ``kv_spec`` vLLM's per-layer KV spec
    (heads, head size, KV quantization mode);
    ``layout`` the KV layout of the stored bytes (the connector's name for
    it); ``block_size`` vLLM's block size in tokens; ``chunk_tokens`` the
    tokens per chunk key, a multiple of ``block_size``; ``fmt`` the object
    format (``"chunkwise"`` or ``"layerwise"``); ``tp_rank``/``tp_size`` the
    tensor-parallel position; ``parallel`` the other parallel sizes that
    split the KV (decode and prefill context parallelism); ``cache_salt`` and
    ``lora`` isolate requests that must not share a cache (per-user salt,
    adapter name and path).
    """

    model: str
    revision: str = ""
    weights: str = ""
    model_config: str = ""
    quantization: str = ""
    dtype: str
    kv_dtype: str
    kv_spec: str = ""
    layout: str
    block_size: int
    chunk_tokens: int
    fmt: str = "chunkwise"
    tp_rank: int = 0
    tp_size: int = 1
    parallel: str = ""
    cache_salt: str = ""
    lora: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            expected = int if field.type in ("int", int) else str
            # bool is an int subclass; a True block size is a caller's mistake.
            if type(value) is not expected:
                raise TypeError(
                    f"KeyNamespace.{field.name} must be {expected.__name__}, "
                    f"got {type(value).__name__} {value!r}"
                )
        if not self.model:
            raise ValueError("KeyNamespace.model must name the model (e.g. its path or repo id)")
        for name in ("block_size", "chunk_tokens", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KeyNamespace.{name} must be positive, got {getattr(self, name)}")
        if self.chunk_tokens % self.block_size:
            raise ValueError(
                f"KeyNamespace.chunk_tokens ({self.chunk_tokens}) must be a multiple of "
                f"block_size ({self.block_size}); set maru_kv_chunk_tokens accordingly"
            )
        if self.fmt not in FORMATS:
            raise ValueError(f"KeyNamespace.fmt must be one of {FORMATS}, got {self.fmt!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"KeyNamespace.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}"
            )

    def canonical_bytes(self) -> bytes:
        """The msgpack encoding hashed by ``digest``: the format version, then
        ``[name, value]`` pairs in field order (stable across processes)."""
        pairs = [[f.name, getattr(self, f.name)] for f in dataclasses.fields(self)]
        return msgpack.packb([KEY_FORMAT_VERSION, pairs], use_bin_type=True)

    def digest(self) -> Key:
        """16-byte blake2b of ``canonical_bytes``: the seed of every chunk key."""
        return Key(hashlib.blake2b(self.canonical_bytes(), digest_size=KEY_BYTES, person=_NS_PERSON).digest())


def _tokens_as_le_int32(token_ids: Sequence[int]) -> bytes:
    # struct packs a list of ints 2-3x faster than array("i", ...) (a 4k-token
    # prompt: 40 vs 100 us on a 2-core VM), little-endian on any host.
    try:
        data = struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as exc:
        if all(type(t) is int or hasattr(t, "__index__") for t in token_ids):
            raise ValueError(f"token ids must fit in int32: {exc}") from None
        raise TypeError(f"token ids must be a sequence of ints: {exc}") from None
    if data:
        lowest = int(np.frombuffer(data, dtype="<i4").min())  # min() over the list: 30x slower
        if lowest < 0:
            raise ValueError(f"token ids must be non-negative, found {lowest}")
    return data


def chunk_keys(
    ns: KeyNamespace, token_ids: Sequence[int], extras: Sequence[bytes | None] | None = None
) -> list[Key]:
    """One key per *full* chunk of ``ns.chunk_tokens`` tokens, in order.

    Key *i* is ``blake2b(key[i-1] || tokens of chunk i as little-endian
    int32 [|| extras[i]], digest_size=16)`` with ``key[-1] = ns.digest()``:
    a key names the whole prefix up to the end of its chunk, so the keys of a
    prompt's first *n* chunks equal the keys of any longer prompt with the
    same first *n* chunks. A trailing partial chunk gets no key.

    ``extras[i]`` (optional, non-empty bytes) is what chunk *i* holds beyond
    its token ids, e.g. the hashes of the images whose placeholder tokens lie
    in it; the token part has a fixed length, so appending it is unambiguous.
    ``None`` (or a list shorter than the chunks) means none.
    """
    return chunk_keys_of_namespaces([ns], token_ids, extras)[0]


def chunk_keys_of_namespaces(
    namespaces: Sequence[KeyNamespace], token_ids: Sequence[int], extras: Sequence[bytes | None] | None = None
) -> list[list[Key]]:
    """``chunk_keys(ns, token_ids, extras)`` for each namespace (e.g. one per
    tensor-parallel rank), with the token ids converted once."""
    data = _tokens_as_le_int32(token_ids)
    return [_chain(ns, data, extras) for ns in namespaces]


def _chain(ns: KeyNamespace, data: bytes, extras: Sequence[bytes | None] | None) -> list[Key]:
    step = ns.chunk_tokens * 4
    keys: list[Key] = []
    prev = ns.digest()
    for i, start in enumerate(range(0, len(data) - step + 1, step)):
        extra = extras[i] if extras is not None and i < len(extras) else None
        if extra is not None and (type(extra) is not bytes or not extra):
            raise ValueError(f"extras[{i}] must be non-empty bytes or None, got {extra!r}")
        piece = data[start : start + step] + extra if extra else data[start : start + step]
        prev = Key(hashlib.blake2b(prev + piece, digest_size=KEY_BYTES).digest())
        keys.append(prev)
    return keys


def block_alias_keys(ns: KeyNamespace, prev: bytes | None, chunk_token_ids: Sequence[int],
                     max_blocks: int) -> list[Key]:
    """The block aliases of one chunk: key *j-1* names the prefix that ends
    after the chunk's first *j* blocks, for *j* = 1 .. ``max_blocks``.

    Alias *j* is ``blake2b(prev || the first j * block_size tokens of the
    chunk as little-endian int32)`` in its own person, so it never equals a
    chunk key; ``prev`` is the previous chunk's key (``None`` for chunk 0:
    the namespace digest). An engine that stores a chunk registers these
    aliases for it: the chunk's first *j* blocks hold the KV of exactly that
    prefix (attention is causal), so a prompt that shares only the first *j*
    blocks of the chunk loads them from it. ``max_blocks`` is below the
    blocks per chunk (alias *blocks per chunk* would be the chunk key) and
    at most the whole blocks of ``chunk_token_ids``; a chunk whose KV also
    depends on something beyond its token ids (multimodal input) has no
    aliases: the caller never asks for them.
    """
    per_chunk = ns.chunk_tokens // ns.block_size
    whole = len(chunk_token_ids) // ns.block_size
    if not 0 <= max_blocks < per_chunk or max_blocks > whole:
        raise ValueError(f"max_blocks must be in [0, {min(per_chunk - 1, whole)}] for a chunk of "
                         f"{per_chunk} blocks with {whole} whole blocks given, got {max_blocks}")
    if prev is None:
        prev = ns.digest()
    _check_key(prev, "prev")
    data = _tokens_as_le_int32(chunk_token_ids[: max_blocks * ns.block_size])
    step = ns.block_size * 4
    running = hashlib.blake2b(prev, digest_size=KEY_BYTES, person=_BLOCKS_PERSON)
    keys: list[Key] = []
    for start in range(0, len(data), step):
        running.update(data[start : start + step])
        keys.append(Key(running.copy().digest()))
    return keys


def _check_key(key: bytes, what: str = "key") -> None:
    if type(key) is not bytes or len(key) != KEY_BYTES:
        shown = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ValueError(f"{what} must be {KEY_BYTES} bytes, got {shown}")


def _check_layers(layers: Iterable[int]) -> tuple[int, ...]:
    layers = tuple(layers)
    for layer in layers:
        if type(layer) is not int or not 0 <= layer <= _U32_MAX:
            raise ValueError(f"layer must be an int in [0, 2**32), got {layer!r}")
    return layers


@functools.lru_cache(maxsize=64)
def _layer_masks(layers: tuple[int, ...]) -> np.ndarray:
    """``[len(layers), 2]`` little-endian u64 words: each layer's 16-byte mask,
    ``blake2b(layer as little-endian u32)`` in the layer person (a model's
    layer list is the same on every call: kept)."""
    masks = b"".join(
        hashlib.blake2b(layer.to_bytes(4, "little"), digest_size=KEY_BYTES, person=_LAYER_PERSON).digest()
        for layer in layers
    )
    out = np.frombuffer(masks, dtype="<u8").reshape(len(layers), 2)
    out.flags.writeable = False
    return out


def packed_layer_keys(chunk_keys: Iterable[bytes] | bytes, layers: Sequence[int]) -> bytes:
    """The layer keys of every chunk, then every layer (chunk-major), end to end.

    ``chunk_keys`` is a sequence of keys or the keys packed end to end (the
    index's wire form); so is the answer, ready for ``retrieve`` and
    ``match_prefix`` without a ``bytes`` object per key. A layer key is the
    chunk key XOR its layer's mask (``layer_key``), so a whole load's keys
    (2,048 for a layerwise 16k-token hit, each derived inside its time to
    first token) are one numpy pass: 0.04 ms, where hashing each one took
    1.1 ms on a 2-core machine.
    """
    layers = _check_layers(layers)
    if isinstance(chunk_keys, bytes):
        packed = chunk_keys
        if len(packed) % KEY_BYTES:
            raise ValueError(f"packed chunk keys must be a multiple of {KEY_BYTES} bytes, got {len(packed)}")
    else:
        chunk_keys = list(chunk_keys)
        for key in chunk_keys:
            _check_key(key, "chunk_key")
        packed = b"".join(chunk_keys)
    words = np.frombuffer(packed, dtype="<u8").reshape(-1, 1, 2)
    return (words ^ _layer_masks(layers)).tobytes()


def split_keys(packed: bytes) -> list[Key]:
    """Keys packed end to end (a multiple of 16 bytes), as a list."""
    # A void dtype keeps every byte (an "S16" one would strip trailing NULs),
    # and tolist() builds the bytes objects in C.
    return np.frombuffer(packed, dtype=f"V{KEY_BYTES}").tolist()


def layer_key(chunk_key: Key, layer: int) -> Key:
    """The key of the layerwise object holding ``layer`` of ``chunk_key``'s chunk.

    ``layer`` is the model's true layer index (not a position in some list
    of layers), so every process derives the same key for the same layer.
    The key is ``chunk_key`` XOR the layer's mask, a blake2b digest of the
    layer index: layer keys are as unique as chunk keys (two (chunk, layer)
    pairs share a key only when two chunk digests differ by exactly the
    difference of two layer digests), and cheap to derive in bulk.
    """
    return Key(packed_layer_keys([chunk_key], (layer,)))


def layer_keys(chunk_key: Key, layers: Iterable[int]) -> list[Key]:
    """``layer_key(chunk_key, layer)`` for each layer, in the order given."""
    return object_layer_keys([chunk_key], tuple(layers))


def object_layer_keys(chunk_keys: Iterable[Key], layers: Sequence[int]) -> list[Key]:
    """``layer_key(ck, layer)`` for every chunk key, then every layer (chunk-major)."""
    return split_keys(packed_layer_keys(chunk_keys, layers))
