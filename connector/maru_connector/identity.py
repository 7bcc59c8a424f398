"""The identity namespace of this engine's keys, built the same way on both halves.

Everything that makes KV bytes meaningful goes into the namespace
(``maru_core.keys.KeyNamespace``): model and revision, dtype, kv-cache dtype,
layout, block size, chunk size, format, TP rank and size, the configured salt
and, per request, vLLM's ``cache_salt`` and LoRA adapter. Two engines that
differ in any of these never share a key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maru_core.keys import KeyNamespace, chunk_keys

from maru_connector.config import MaruConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def layout_id(kv_cache_config: "KVCacheConfig") -> str:
    """The paged-KV layout both halves agree on: device type and vLLM's layout."""
    from vllm.platforms import current_platform

    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    return f"{current_platform.device_type}/{layout}"


def block_size_of(kv_cache_config: "KVCacheConfig") -> int:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"MaruKVConnector supports models with one KV cache group; this model has "
            f"{len(groups)} (hybrid attention); run it without the connector"
        )
    return groups[0].kv_cache_spec.block_size


def base_namespaces(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: MaruConfig
) -> tuple[KeyNamespace, ...]:
    """One namespace per TP rank (index = rank), without per-request salt or LoRA."""
    model = vllm_config.model_config
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    return tuple(
        KeyNamespace(
            model=cfg.maru_model_id or str(model.model),
            revision=str(model.revision or ""),
            dtype=str(model.dtype).removeprefix("torch."),
            kv_dtype=str(vllm_config.cache_config.cache_dtype),
            layout=layout_id(kv_cache_config),
            block_size=block_size_of(kv_cache_config),
            chunk_tokens=cfg.maru_kv_chunk_tokens,
            fmt=cfg.fmt_name,
            tp_rank=rank,
            tp_size=tp_size,
            cache_salt=cfg.maru_cache_salt,
            lora="",
        )
        for rank in range(tp_size)
    )


@dataclass(frozen=True)
class RequestKeys:
    """The chunk keys of one request's prompt, one tuple per TP rank."""

    by_rank: tuple[tuple[bytes, ...], ...]

    @property
    def num_chunks(self) -> int:
        return len(self.by_rank[0])

    def slice(self, start: int, stop: int) -> tuple[tuple[bytes, ...], ...]:
        return tuple(keys[start:stop] for keys in self.by_rank)


def request_keys(namespaces: tuple[KeyNamespace, ...], request: "Request") -> RequestKeys:
    """Chunk keys of every full chunk of the request's prompt, for every rank."""
    salt = request.cache_salt or ""
    lora = request.lora_request.lora_name if request.lora_request is not None else ""
    tokens = list(request.prompt_token_ids or ())
    by_rank = []
    for ns in namespaces:
        if salt or lora:
            joined = f"{ns.cache_salt}|{salt}" if salt else ns.cache_salt
            ns = dataclasses.replace(ns, cache_salt=joined, lora=lora)
        by_rank.append(tuple(chunk_keys(ns, tokens)))
    return RequestKeys(tuple(by_rank))
