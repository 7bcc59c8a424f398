"""The identity namespace of this engine's keys, built the same way on both halves.

Everything that makes KV bytes meaningful goes into the namespace
(``maru_core.keys.KeyNamespace``): the model (a fingerprint of its files, not
its path), its effective configuration (overrides, rope scaling), weight
quantization, dtype, kv-cache dtype and spec, the layout both halves know at
start-up, block size, chunk size, format, TP rank and size, context-parallel
sizes, the configured salt and, per request, vLLM's ``cache_salt`` and LoRA
adapter (a fingerprint of its files, see :func:`adapter_id`). What a chunk holds beyond token ids — multimodal
inputs, prompt embeddings — goes into its key through the extra keys vLLM's
own prefix cache hashes. Two engines that differ in any of these never share
a key.

What keys cannot make safe is refused at start-up
(:func:`check_engine_supported`): pipeline and context parallelism, sliding
window and chunked-local attention, and ``kv_load_failure_policy: fail``.

The worker's detected KV layout is not known to the scheduler half when it
builds keys, so it travels in the slot header instead
(``ObjectFormat.fingerprint``): a reader never uses bytes arranged in a
layout other than its own, whatever the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import msgpack
from maru_core.keys import KeyNamespace, block_alias_keys, chunk_keys_of_namespaces

from maru_connector.config import MaruConfig, MaruConfigError
from maru_connector.log import get_logger

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = get_logger(__name__)

# ---------------------------------------------------------------- start-up checks


def check_engine_supported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
    """Refuse, with one line that says what to change, an engine whose KV the keys
    cannot make safe to share. Called by both halves at construction."""
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise MaruConfigError(
            f"kv_load_failure_policy={policy!r} turns every failed MaruCache load into a failed "
            'request; set "kv_load_failure_policy": "recompute" in --kv-transfer-config '
            "(maru_connector.make_kv_transfer_config does)"
        )
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size > 1:
        raise MaruConfigError(
            f"MaruKVConnector does not support pipeline parallelism (pipeline_parallel_size="
            f"{par.pipeline_parallel_size}): each stage holds other layers under the same keys; "
            "use tensor parallelism instead"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(par, name, 1) > 1:
            raise MaruConfigError(
                f"MaruKVConnector does not support context parallelism ({name}="
                f"{getattr(par, name)}): a block's tokens are spread over ranks; set it to 1"
            )
    block_size_of(kv_cache_config)  # one KV cache group
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    other = _not_full_attention(spec, vllm_config.model_config.get_sliding_window())
    if other is not None:
        raise MaruConfigError(
            f"MaruKVConnector supports full attention only; this model's KV cache uses {other} "
            "(vLLM frees or rewrites blocks while a request runs); run it without the connector"
        )


def _not_full_attention(spec: Any, model_window: int | None) -> str | None:
    """What other attention than plain full attention the KV spec or model uses, if any."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    window = getattr(spec, "sliding_window", None) or model_window
    if window:
        return f"sliding window {window}"
    chunk = getattr(spec, "attention_chunk_size", None)
    if chunk:
        return f"chunked local attention {chunk}"
    return None if type(spec) is FullAttentionSpec else type(spec).__name__


def block_size_of(kv_cache_config: "KVCacheConfig") -> int:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"MaruKVConnector supports models with one KV cache group; this model has "
            f"{len(groups)} (hybrid attention); run it without the connector"
        )
    return groups[0].kv_cache_spec.block_size


# ---------------------------------------------------------------- model identity

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
_EDGE_BYTES = 1 << 20  # read whole at both ends of each file (safetensors headers, first tensors)
_PIECE_BYTES = 64 << 10
_PIECES = 32  # spread evenly between the ends


_MODEL_CONFIG = "config.json"
_ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter's rank, alpha and target modules


def _model_files(model_dir: Path, config_name: str = _MODEL_CONFIG) -> list[Path]:
    files = []
    for path in model_dir.rglob("*"):
        parts = path.relative_to(model_dir).parts
        if any(p.startswith(".") for p in parts) or not path.is_file():
            continue
        if path.name == config_name or path.suffix in _WEIGHT_SUFFIXES:
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(model_dir).as_posix())


def _sample_offsets(size: int) -> list[tuple[int, int]]:
    if size <= 2 * _EDGE_BYTES + _PIECES * _PIECE_BYTES:
        return [(0, size)]
    middle = range(_EDGE_BYTES, size - _EDGE_BYTES - _PIECE_BYTES, (size - 2 * _EDGE_BYTES) // _PIECES)
    return [(0, _EDGE_BYTES), *((o, _PIECE_BYTES) for o in middle), (size - _EDGE_BYTES, _EDGE_BYTES)]


def weights_fingerprint(model_dir: Path, config_name: str = _MODEL_CONFIG) -> str | None:
    """A digest of the model's files as they lie on disk: each weight file's name,
    size and bytes sampled at both ends and at 32 points between, and its
    ``config_name`` (``config.json``; an adapter's ``adapter_config.json``) whole.
    The same files give the same digest on every machine, wherever they are
    mounted; ``None`` when the directory holds no weight file."""
    return _fingerprint_of_files(model_dir, _model_files(model_dir, config_name))


def _fingerprint_of_files(model_dir: Path, files: list[Path]) -> str | None:
    if not any(f.suffix in _WEIGHT_SUFFIXES for f in files):
        return None
    digest = hashlib.blake2b(digest_size=16, person=b"maru.weights")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(model_dir).as_posix()}\0{size}\0".encode())
        with path.open("rb") as f:
            for offset, length in _sample_offsets(size):
                f.seek(offset)
                digest.update(f.read(length))
    return digest.hexdigest()


def _model_dir(model_config: "ModelConfig") -> Path | None:
    """Where the model's files are: its path, or its snapshot in the Hugging Face cache."""
    return _local_dir(str(model_config.model), _MODEL_CONFIG, model_config.revision)


def _local_dir(name_or_path: str, config_name: str, revision: str | None = None) -> Path | None:
    """A directory on this machine, or a repo's snapshot already in the Hugging
    Face cache (never downloaded: this runs on the engine thread)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name_or_path, config_name, revision=revision)
    except Exception:  # not a repo id, or no cache: fall back to the name
        return None
    return Path(found).parent if isinstance(found, str) else None


def config_digest(model_config: "ModelConfig") -> str:
    """A digest of the effective model configuration: the Hugging Face config after
    vLLM applied ``hf_overrides`` (rope scaling, context length, ...), without the
    fields that name where it was loaded from."""
    hf = model_config.hf_config.to_dict()
    kept = {k: v for k, v in hf.items() if not k.startswith("_") and k != "transformers_version"}
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"maru.config").hexdigest()


class ModelIdentity(TypedDict):
    """The namespace fields that name the model (``KeyNamespace``'s)."""

    model: str
    revision: str
    weights: str
    model_config: str
    quantization: str


def model_identity(model_config: "ModelConfig", cfg: MaruConfig) -> ModelIdentity:
    """The namespace fields naming the model: ``model``, ``revision``, ``weights``,
    ``model_config``, ``quantization``. The model's path is used only when its
    files cannot be read (with a warning): a path does not name weights."""
    model_dir = _model_dir(model_config)
    weights = weights_fingerprint(model_dir) if model_dir is not None else None
    if weights is None and cfg.maru_model_id is None:
        logger.warning(
            "MaruCache cannot read the files of model %s; its keys rely on the name and "
            "revision. Set maru_model_id to a name that changes whenever the weights do.",
            model_config.model,
        )
    return {
        "model": cfg.maru_model_id or (f"files:{weights}" if weights else str(model_config.model)),
        "revision": "" if weights else str(model_config.revision or ""),
        "weights": weights or "",
        "model_config": config_digest(model_config),
        "quantization": str(model_config.quantization or ""),
    }


# ---------------------------------------------------------------- LoRA adapters


class AdapterUnreadable(Exception):
    """A request's LoRA adapter has no files this engine can fingerprint, or files
    that changed under an adapter vLLM may still hold: its KV is neither looked
    up nor stored (a guessed key could name another adapter's KV)."""


_WARN_EVERY_S = 60.0  # per adapter path: one warning, not one per request


_Signature = tuple[tuple[str, int, int, int, int], ...]
_FINGERPRINTS: OrderedDict[tuple[str, _Signature], str | None] = OrderedDict()  # most recent last
_FINGERPRINTS_KEPT = 64
_FINGERPRINTS_LOCK = threading.Lock()  # engines of one process may share it
_RACY_NS = 2_000_000_000  # a file modified this recently may change again within its timestamp's tick


def _adapter_fingerprint(adapter_dir: Path, signature: _Signature) -> str | None:
    """The adapter's fingerprint, hashed once per signature of its files.

    A file modified in the last two seconds is hashed again at the next
    lookup: a second write within the file system's timestamp tick, of the
    same size, would otherwise leave the signature unchanged (git's "racily
    clean" entries)."""
    key = (str(adapter_dir), signature)
    with _FINGERPRINTS_LOCK:
        if key in _FINGERPRINTS:
            _FINGERPRINTS.move_to_end(key)
            return _FINGERPRINTS[key]
    digest = _fingerprint_of_files(adapter_dir, [adapter_dir / entry[0] for entry in signature])
    if all(time.time_ns() - mtime_ns > _RACY_NS for _, _, mtime_ns, _, _ in signature):
        with _FINGERPRINTS_LOCK:
            _FINGERPRINTS[key] = digest
            while len(_FINGERPRINTS) > _FINGERPRINTS_KEPT:
                _FINGERPRINTS.popitem(last=False)
    return digest


def _files_signature(adapter_dir: Path) -> _Signature:
    """Each fingerprinted file's name, size, mtime, ctime and inode: a file written
    (ctime moves even when a copy keeps the mtime) or replaced changes it."""
    signature = []
    for path in _model_files(adapter_dir, _ADAPTER_CONFIG):
        st = path.stat()
        signature.append((path.relative_to(adapter_dir).as_posix(), st.st_size, st.st_mtime_ns,
                          st.st_ctime_ns, st.st_ino))
    return tuple(signature)


def adapter_fingerprint(lora_path: str) -> str:
    """``files:<digest>`` of a LoRA adapter's files: :func:`weights_fingerprint`
    of its weight files and ``adapter_config.json``, so two adapters share KV
    exactly when their files are the same, whatever their name or path.

    The digest is cached by the files' signature (:func:`_files_signature`):
    a request costs a ``stat`` per file, and a file changed in place is hashed
    again. Raises :class:`AdapterUnreadable` when the path is no local directory
    (or cached Hugging Face snapshot) holding weight files, or cannot be read.
    """
    try:
        adapter_dir = _local_dir(lora_path, _ADAPTER_CONFIG) if lora_path else None
        if adapter_dir is None:
            raise AdapterUnreadable(f"{lora_path!r} is no directory here nor a cached snapshot")
        adapter_dir = adapter_dir.resolve()
        digest = _adapter_fingerprint(adapter_dir, _files_signature(adapter_dir))
    except OSError as exc:
        raise AdapterUnreadable(f"{lora_path!r}: {type(exc).__name__}: {exc}") from None
    if digest is None:
        raise AdapterUnreadable(f"{lora_path!r} holds no weight file")
    return f"files:{digest}"


class AdapterIdentities:
    """The fingerprint of each LoRA adapter this engine serves, by vLLM's adapter id.

    vLLM keeps an adapter's weights loaded under its id and reads its files
    again only with ``load_inplace`` (or after evicting it), so the files on
    disk name the weights in memory only until they change: an adapter whose
    files changed since its id was first seen is refused (no lookups, no
    stores) until a request reloads it with ``load_inplace``, or it is served
    under a new id. A reload that changed the weights is reported once by
    :meth:`take_reloaded`: requests of that id already running go on with
    the new weights under keys of the old ones.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._first_seen: dict[int, str] = {}
        self._reloaded: set[int] = set()
        self._warned_at: dict[str, float] = {}
        self._clock = clock

    def of(self, lora: "LoRARequest") -> str:
        """The adapter's namespace field; raises :class:`AdapterUnreadable`."""
        path = str(getattr(lora, "lora_path", "") or "")
        try:
            fingerprint = adapter_fingerprint(path)
            seen = self._first_seen.setdefault(lora.lora_int_id, fingerprint)
            if getattr(lora, "load_inplace", False) and seen != fingerprint:
                self._first_seen[lora.lora_int_id] = seen = fingerprint
                self._reloaded.add(lora.lora_int_id)
            if seen != fingerprint:
                raise AdapterUnreadable(f"{path!r} changed since adapter id {lora.lora_int_id} was loaded; "
                                        "reload it with load_inplace or serve it under a new id")
        except AdapterUnreadable as exc:
            self._warn(path, str(exc))
            raise
        return fingerprint

    def take_reloaded(self) -> set[int]:
        """Adapter ids whose weights a ``load_inplace`` changed since the last call."""
        reloaded, self._reloaded = self._reloaded, set()
        return reloaded

    def _warn(self, path: str, why: str) -> None:
        now = self._clock()
        if now - self._warned_at.get(path, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            if len(self._warned_at) > 1024:  # paths come from requests: keep this bounded
                self._warned_at.clear()
            self._warned_at[path] = now
            logger.warning("MaruCache neither looks up nor stores the KV of requests with LoRA adapter %s",
                           why, extra={"repeat_kind": path})  # paced per adapter here


# ---------------------------------------------------------------- namespaces


def layout_id(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> str:
    """The paged-KV layout both halves know at start-up: device type, the layout vLLM's
    engine core resolved, and the attention backend asked for. The layout the worker
    detects goes into every slot header (``ObjectFormat.fingerprint``)."""
    from vllm.platforms import current_platform

    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    backend_name = getattr(backend, "name", None) or "auto"
    return f"{current_platform.device_type}/{layout}/{backend_name}"


def kv_spec_id(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> str:
    """vLLM's per-layer KV spec: what one token's KV of one layer is."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    from vllm.v1.kv_cache_interface import AttentionSpec

    if not isinstance(spec, AttentionSpec):  # what the connector stores is attention KV
        raise MaruConfigError(f"the KV cache is a {type(spec).__name__}, not attention KV: MaruCache "
                              "shares attention KV caches only; remove the kv-transfer-config")
    quant = getattr(spec, "kv_quant_mode", None)
    skip = ",".join(vllm_config.cache_config.kv_cache_dtype_skip_layers or ())
    return (
        f"{type(spec).__name__}:heads={spec.num_kv_heads},head={spec.head_size},"
        f"head_v={getattr(spec, 'head_size_v', spec.head_size)},"
        f"dtype={str(spec.dtype).removeprefix('torch.')},"
        f"quant={getattr(quant, 'name', quant)},skip={skip}"
    )


def parallel_id(vllm_config: "VllmConfig") -> str:
    par = vllm_config.parallel_config
    return (
        f"dcp={getattr(par, 'decode_context_parallel_size', 1)},"
        f"pcp={getattr(par, 'prefill_context_parallel_size', 1)},"
        f"interleave={getattr(par, 'cp_kv_cache_interleave_size', 1)}"
    )


def base_namespaces(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: MaruConfig
) -> tuple[KeyNamespace, ...]:
    """One namespace per TP rank (index = rank), without per-request salt or LoRA."""
    model = vllm_config.model_config
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    first = KeyNamespace(
        **model_identity(model, cfg),
        dtype=str(model.dtype).removeprefix("torch."),
        kv_dtype=str(vllm_config.cache_config.cache_dtype),
        kv_spec=kv_spec_id(vllm_config, kv_cache_config),
        layout=layout_id(vllm_config, kv_cache_config),
        block_size=block_size_of(kv_cache_config),
        chunk_tokens=cfg.maru_kv_chunk_tokens,
        fmt=cfg.fmt_name,
        tp_size=tp_size,
        parallel=parallel_id(vllm_config),
        cache_salt=cfg.maru_cache_salt,
        lora="",
    )
    return tuple(dataclasses.replace(first, tp_rank=rank) for rank in range(tp_size))


# ---------------------------------------------------------------- per request


@dataclass(frozen=True)
class RequestKeys:
    """The chunk keys of one request's prompt, one tuple per TP rank, and
    what its chunks' block aliases are derived from (:meth:`block_aliases`).

    ``namespaces``: the request's namespace per rank (``None``: the request
    has no block aliases, e.g. its KV depends on multimodal input, whose
    offsets a prefix of a chunk would cut); ``tokens``: its prompt.
    """

    by_rank: tuple[tuple[bytes, ...], ...]
    namespaces: tuple[KeyNamespace, ...] | None = None
    tokens: tuple[int, ...] = ()

    @property
    def num_chunks(self) -> int:
        return len(self.by_rank[0])

    def slice(self, start: int, stop: int) -> tuple[tuple[bytes, ...], ...]:
        return tuple(keys[start:stop] for keys in self.by_rank)

    def alias_blocks(self, chunk: int) -> int:
        """How many block aliases chunk ``chunk`` has: the whole blocks of the
        prompt in it, below a whole chunk (0 without aliases)."""
        if self.namespaces is None or chunk > self.num_chunks:
            return 0
        ns = self.namespaces[0]
        in_chunk = min(len(self.tokens) - chunk * ns.chunk_tokens, ns.chunk_tokens - 1)
        return max(0, in_chunk // ns.block_size)

    def block_aliases(self, rank: int, chunk: int, max_blocks: int) -> list[bytes]:
        """Rank ``rank``'s aliases of chunk ``chunk`` (``maru_core.keys.block_alias_keys``):
        its first 1 .. ``max_blocks`` blocks, in that order."""
        assert self.namespaces is not None, "a request without block aliases"
        ns = self.namespaces[rank]
        start = chunk * ns.chunk_tokens
        prev = self.by_rank[rank][chunk - 1] if chunk else None
        return list(block_alias_keys(ns, prev, self.tokens[start : start + ns.chunk_tokens], max_blocks))


def request_is_cacheable(request: "Request") -> tuple[bool, str]:
    """Whether the request's KV may be looked up and stored, and if not, why.

    Multimodal inputs and prompt embeddings are covered by the keys (see
    :func:`chunk_extras`); a request is refused only when something its KV depends
    on cannot be hashed: no prompt token ids, or a multimodal input vLLM gave no
    identifier. The scheduler half neither looks up nor stores such a request.
    """
    if request.prompt_token_ids is None:
        return False, "the prompt has no token ids"
    for feature in getattr(request, "mm_features", None) or ():
        if getattr(feature, "identifier", None) is None:
            return False, "a multimodal input has no hash"
    return True, ""


def chunk_extras(request: "Request", num_chunks: int, chunk_tokens: int) -> list[bytes | None] | None:
    """Per chunk, what its KV depends on beyond token ids, as vLLM's own prefix cache
    hashes it (``generate_block_hash_extra_keys``): the hash and offset of every
    multimodal input with placeholder tokens in the chunk, and the hash of its prompt
    embeddings. ``None`` for a request with neither (no per-chunk work)."""
    if not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None:
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    extras: list[bytes | None] = []
    mm_index = 0
    for i in range(num_chunks):
        keys, mm_index = generate_block_hash_extra_keys(
            request, i * chunk_tokens, (i + 1) * chunk_tokens, mm_index
        )
        extras.append(msgpack.packb(list(keys), use_bin_type=True) if keys else None)
    return extras


def _request_namespace(ns: KeyNamespace, request: "Request", lora_id: str) -> KeyNamespace:
    salt = request.cache_salt or ""
    if not salt and not lora_id:
        return ns
    joined = f"{ns.cache_salt}|{salt}" if salt else ns.cache_salt
    return dataclasses.replace(ns, cache_salt=joined, lora=lora_id)


def request_keys(namespaces: tuple[KeyNamespace, ...], request: "Request",
                 adapters: AdapterIdentities | None = None) -> RequestKeys:
    """Chunk keys of every full chunk of the request's prompt, for every rank.

    A LoRA adapter is named by its files (``adapters``: the engine's
    :class:`AdapterIdentities`; a fresh one when None). Raises
    :class:`AdapterUnreadable` when they cannot name it: the request then has
    no keys at all, never a guessed one.
    """
    lora = request.lora_request
    lora_id = (adapters or AdapterIdentities()).of(lora) if lora is not None else ""
    tokens = list(request.prompt_token_ids or ())
    chunk = namespaces[0].chunk_tokens
    extras = chunk_extras(request, len(tokens) // chunk, chunk)
    request_namespaces = tuple(_request_namespace(ns, request, lora_id) for ns in namespaces)
    per_rank = chunk_keys_of_namespaces(request_namespaces, tokens, extras)
    plain = extras is None  # token ids alone name its KV: a chunk's blocks may be aliased
    return RequestKeys(tuple(tuple(keys) for keys in per_rank),
                       request_namespaces if plain else None, tuple(tokens) if plain else ())
