"""The connector's knobs: ``kv_connector_extra_config`` parsed once, strictly.

Every knob is a field of :class:`MaruConfig`, a frozen dataclass built by
:func:`parse_config` at connector start-up. An unknown key, a value of the
wrong type or an impossible combination stops start-up with a
:class:`MaruConfigError` that names the key and says what to change; nothing
else in the connector reads the raw dict.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maru_core.protocol.url import parse_url

from .transfer.copy_cpus import CopyCpusError, check_priority, parse_setting

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "MaruKVConnector"
PREFAULT_UNSET_MAX_BYTES = 64 << 30  # 128 MiB of page tables per worker
CONNECTOR_MODULE = "maru_connector"


class MaruConfigError(ValueError):
    """A knob in ``kv_connector_extra_config`` is unknown, ill-typed or conflicting."""


@dataclass(frozen=True)
class MaruConfig:
    """The validated connector configuration (DESIGN §5 knob names)."""

    maru_index_url: str
    maru_pool_path: str | None = None
    maru_sidecar_socket: str | None = None
    maru_token: str | None = None
    maru_token_file: str | None = None
    maru_cache_name: str = "default"
    maru_kv_chunk_tokens: int = 256
    maru_use_layerwise: bool = False
    maru_async_load: bool = False
    maru_park_lone_hits: bool = False
    maru_overlap_load_with_compute: bool = False
    maru_overlap_release_after_layers: int = 1
    maru_async_store: bool = True
    # Pin what a lookup matched right after it, for a worker in the same
    # process (early_pins.py); off: the worker retrieves, one round trip more.
    maru_early_pins: bool = True
    maru_lookup_timeout_s: float = 0.05
    maru_load_timeout_s: float = 10.0
    maru_model_id: str | None = None
    maru_cache_salt: str = ""
    maru_stats_dir: str | None = None
    # None: on (both backends), see verify_payload().
    maru_verify_payload: bool | None = None
    # CPU backend: map the pool's pages in the background at start, so hits
    # and stores take no page fault per page they touch (transfer/prefault.py).
    # None: on up to PREFAULT_UNSET_MAX_BYTES of pool, see prefault_pool().
    maru_prefault_pool: bool | None = None
    # CPU backend: the cores the copy threads run on (transfer/copy_cpus.py):
    # "auto" (those vLLM's CPU worker leaves out of the forward's OpenMP
    # team, if any), "none" (unpinned) or a list like "2,6-7".
    maru_copy_cpus: str = "auto"
    # CPU backend: "idle" runs the load thread only on cores the forward
    # leaves idle (Linux SCHED_IDLE), "normal" as any other thread; the
    # store thread always at normal priority (transfer/cpu.py says why).
    maru_copy_priority: str = "idle"

    @property
    def fmt_name(self) -> str:
        """The storage format as it appears in the key namespace."""
        return "layerwise" if self.maru_use_layerwise else "chunkwise"

    def verify_payload(self, device_type: str, fmt: Any = None) -> bool:
        """Whether loads check the bytes they receive against each object's payload
        checksum before the forward may use them.

        ``maru_verify_payload`` decides when set; unset, it is on for both
        backends: the checksum is summed where the bytes land (the CPU engine's
        copy thread; on CUDA a kernel over the device staging at HBM speed),
        a small part of a hit on either (docs/architecture.md, "Payload
        checksums"). ``device_type`` is kept for callers that pass it.
        ``fmt`` (the worker's object format): a layout whose blocks are not
        whole 32-bit words cannot be summed: off then, with a warning when
        unset, a ``MaruConfigError`` when set to true.
        """
        wanted = True if self.maru_verify_payload is None else self.maru_verify_payload
        if wanted and fmt is not None:
            from maru_connector.transfer.checks import checkable

            if not checkable(fmt):
                where = f"layout {fmt.layout.kind} has segments of {fmt.layout.segment_bytes} bytes"
                if self.maru_verify_payload:
                    raise MaruConfigError(f"maru_verify_payload: {where}, not whole 32-bit words; set it to false")
                logger.warning("payload checks are off: %s, not whole 32-bit words", where)
                return False
        return wanted

    def prefault_pool(self, pool_bytes: int) -> bool:
        """Whether the CPU backend maps the pool's pages at start.

        ``maru_prefault_pool`` decides when set. Unset, it is on for pools up
        to ``PREFAULT_UNSET_MAX_BYTES``: every GiB costs each worker 2 MiB of
        page tables and about 0.1 s of a core, so a pool of terabytes is
        mapped ahead only when asked for.
        """
        if self.maru_prefault_pool is not None:
            return self.maru_prefault_pool
        return pool_bytes <= PREFAULT_UNSET_MAX_BYTES

    def resolve_token(self) -> str | None:
        """The index token: inline, or read from ``maru_token_file``."""
        if self.maru_token is not None:
            return self.maru_token
        if self.maru_token_file is not None:
            try:
                return Path(self.maru_token_file).read_text().strip()
            except OSError as exc:
                raise MaruConfigError(
                    f"maru_token_file={self.maru_token_file!r} cannot be read ({exc}); "
                    "point it at the file holding the cache's index token"
                ) from exc
        return None


_FIELDS = {f.name: f for f in dataclasses.fields(MaruConfig)}
_KIND = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
}


def _expected_type(name: str) -> type:
    annotation = str(_FIELDS[name].type)
    for kind in (bool, int, float, str):
        if annotation.startswith(kind.__name__):
            return kind
    raise AssertionError(f"unhandled annotation {annotation} for {name}")


def _check_value(name: str, value: Any) -> Any:
    """Check one raw value against its field's type; ints pass for floats."""
    kind = _expected_type(name)
    optional = "None" in str(_FIELDS[name].type)
    if value is None and optional:
        return None
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise MaruConfigError(
            f"kv_connector_extra_config[{name!r}] must be {_KIND[kind]}, "
            f"got {type(value).__name__} {value!r}"
        )
    return value


def _reject_unknown(raw: dict[str, Any]) -> None:
    for key in raw:
        if key in _FIELDS:
            continue
        close = difflib.get_close_matches(key, list(_FIELDS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise MaruConfigError(
            f"unknown key {key!r} in kv_connector_extra_config{hint} "
            f"(known keys: {', '.join(sorted(_FIELDS))})"
        )


def _check_combination(cfg: MaruConfig) -> None:
    try:
        parse_url(cfg.maru_index_url)  # the index client's own check of its address
    except ValueError as exc:
        raise MaruConfigError(
            f"maru_index_url: {exc} (it must look like tcp://HOST:PORT or unix:///PATH)"
        ) from None
    if (cfg.maru_pool_path is None) == (cfg.maru_sidecar_socket is None):
        raise MaruConfigError(
            "set exactly one of maru_pool_path (attach the pool file directly) "
            "or maru_sidecar_socket (receive it from the sidecar)"
        )
    if cfg.maru_stats_dir is not None and cfg.maru_sidecar_socket is not None:
        raise MaruConfigError(
            "maru_stats_dir is for direct attach (maru_pool_path); with "
            "maru_sidecar_socket the counters go to the sidecar's directory: remove maru_stats_dir"
        )
    if cfg.maru_token is not None and cfg.maru_token_file is not None:
        raise MaruConfigError("set maru_token or maru_token_file, not both")
    if cfg.maru_kv_chunk_tokens <= 0:
        raise MaruConfigError(
            f"maru_kv_chunk_tokens must be positive, got {cfg.maru_kv_chunk_tokens}"
        )
    if cfg.maru_overlap_release_after_layers < 0:
        raise MaruConfigError(
            "maru_overlap_release_after_layers must be at least 0, got "
            f"{cfg.maru_overlap_release_after_layers}"
        )
    try:
        parse_setting(cfg.maru_copy_cpus)
        check_priority(cfg.maru_copy_priority)
    except CopyCpusError as exc:
        raise MaruConfigError(str(exc)) from None
    for name in ("maru_lookup_timeout_s", "maru_load_timeout_s"):
        if getattr(cfg, name) <= 0:
            raise MaruConfigError(f"{name} must be positive, got {getattr(cfg, name)}")


def align_chunk_tokens(chunk_tokens: int, block_size: int) -> int:
    """Round ``chunk_tokens`` up to a multiple of vLLM's block size (warns)."""
    if chunk_tokens % block_size == 0:
        return chunk_tokens
    aligned = -(-chunk_tokens // block_size) * block_size
    logger.warning(
        "maru_kv_chunk_tokens=%d is not a multiple of vLLM's block size %d; "
        "using %d",
        chunk_tokens,
        block_size,
        aligned,
    )
    return aligned


def parse_config(raw: dict[str, Any] | None, block_size: int | None = None) -> MaruConfig:
    """Build the :class:`MaruConfig` from ``kv_connector_extra_config``.

    Args:
        raw: the extra-config dict as vLLM hands it over.
        block_size: vLLM's KV block size; when given, ``maru_kv_chunk_tokens``
            is aligned up to a multiple of it.

    Raises:
        MaruConfigError: on an unknown key (with the closest known name), a
            missing ``maru_index_url``, an ill-typed value or a conflict.
    """
    raw = dict(raw or {})
    _reject_unknown(raw)
    if "maru_index_url" not in raw:
        raise MaruConfigError(
            "kv_connector_extra_config needs 'maru_index_url' (tcp://HOST:PORT or "
            "unix:///PATH of the MaruCache index)"
        )
    values = {name: _check_value(name, value) for name, value in raw.items()}
    cfg = MaruConfig(**values)
    _check_combination(cfg)
    if block_size is not None:
        aligned = align_chunk_tokens(cfg.maru_kv_chunk_tokens, block_size)
        cfg = dataclasses.replace(cfg, maru_kv_chunk_tokens=aligned)
    return cfg


def make_kv_transfer_config(
    index_url: str,
    pool_path: str | None = None,
    *,
    sidecar_socket: str | None = None,
    **knobs: Any,
) -> dict[str, Any]:
    """The complete ``--kv-transfer-config`` for MaruCache, validated.

    Args:
        index_url: the index, ``tcp://HOST:PORT`` or ``unix:///PATH``.
        pool_path: the pool file (direct attach), or
        sidecar_socket: the sidecar's Unix socket (fd hand-off).
        **knobs: further knobs, with or without their ``maru_`` prefix
            (``async_load=True`` and ``maru_async_load=True`` are the same).

    Returns:
        A dict for ``KVTransferConfig(**d)`` / ``--kv-transfer-config``; load
        failures are recomputed (``kv_load_failure_policy="recompute"``).
    """
    extra: dict[str, Any] = {"maru_index_url": index_url}
    if pool_path is not None:
        extra["maru_pool_path"] = str(pool_path)
    if sidecar_socket is not None:
        extra["maru_sidecar_socket"] = str(sidecar_socket)
    for key, value in knobs.items():
        extra[key if key.startswith("maru_") else f"maru_{key}"] = value
    parse_config(extra)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
