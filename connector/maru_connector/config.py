"""The connector's knobs: ``kv_connector_extra_config`` parsed once, strictly.

The knobs themselves (names, types, defaults, the parser and the
``--kv-transfer-config`` builder) are defined once in
:mod:`maru_core.connector_config`, which the operator writes its pods'
config with; :class:`MaruConfig` adds the connector's behaviour on top.
:func:`parse_config` builds it at connector start-up: an unknown key, a
value of the wrong type or an impossible combination stops start-up with a
:class:`MaruConfigError` that names the key and says what to change; nothing
else in the connector reads the raw dict.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maru_core.connector_config import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    ConnectorConfigError,
    ConnectorKnobs,
    check_index_url,
    kv_transfer_config,
    parse_knobs,
    same_index,
)

from .log import get_logger
from .transfer.copy_cpus import CopyCpusError, check_priority, parse_setting

logger = get_logger(__name__)

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "MaruConfig", "MaruConfigError", "PREFAULT_UNSET_MAX_BYTES",
           "align_chunk_tokens", "make_kv_transfer_config", "parse_config"]

PREFAULT_UNSET_MAX_BYTES = 64 << 30  # 128 MiB of page tables per worker

# The connector's name for the core's error: ``except MaruConfigError`` catches every knob error.
MaruConfigError = ConnectorConfigError


#: How long a token file that a sidecar writes (a pod credential) is waited for.
TOKEN_FILE_WAIT_S = 5.0


@dataclass(frozen=True)
class MaruConfig(ConnectorKnobs):
    """The validated connector configuration: the knobs of :class:`ConnectorKnobs`
    (``storage_format``, ``fmt_name`` and the deprecated ``maru_use_layerwise``
    read ``maru_format``) and what the connector derives from them."""

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

    def resolve_index_url(self, handoff_url: str | None = None) -> str:
        """The index address: ``maru_index_url``, or the one the sidecar's hand-off carries.

        With both, they must name the same index: the sidecar's is where its
        pool's objects are indexed, so a connector asking another index would
        be refused every object (or, worse, find none); the error says which
        to change. Direct attach (no hand-off): ``maru_index_url``, which
        :func:`parse_config` requires there.
        """
        if handoff_url is None:
            if self.maru_index_url is None:
                raise MaruConfigError("maru_index_url is not set and no sidecar hand-off gave an index address; "
                                      "set maru_index_url (tcp://HOST:PORT or unix:///PATH)")
            return self.maru_index_url
        check_index_url(f"the index address the sidecar at {self.maru_sidecar_socket} hands over", handoff_url)
        if self.maru_index_url is not None and not same_index(self.maru_index_url, handoff_url):
            raise MaruConfigError(
                f"maru_index_url={self.maru_index_url!r} differs from the index the sidecar at "
                f"{self.maru_sidecar_socket} serves its pool with ({handoff_url!r}); remove maru_index_url "
                "(the sidecar's hand-off carries it) or make the two agree")
        return handoff_url

    def resolve_token(self) -> str | None:
        """The index token: inline, or read from ``maru_token_file``. With a sidecar, a file that
        does not exist yet is waited for, ``TOKEN_FILE_WAIT_S`` at most: it may be the pod's
        credential, which the sidecar writes at start (before it serves its socket)."""
        if self.maru_token is not None:
            return self.maru_token
        if self.maru_token_file is not None:
            wait_s = TOKEN_FILE_WAIT_S if self.maru_sidecar_socket is not None else 0.0
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    return Path(self.maru_token_file).read_text().strip()
                except FileNotFoundError:
                    if time.monotonic() >= deadline:
                        raise MaruConfigError(self._unreadable_token(f"no such file after {wait_s:g} s")) from None
                    time.sleep(0.05)
                except OSError as exc:
                    raise MaruConfigError(self._unreadable_token(str(exc))) from exc
        return None

    def _unreadable_token(self, why: str) -> str:
        return (f"maru_token_file={self.maru_token_file!r} cannot be read ({why}); point it at the file holding "
                "the cache's index token, or the pod credential its sidecar writes (--credential-file)")


def _check_copy_settings(cfg: MaruConfig) -> None:
    """The CPU copy threads' settings, whose syntax only the connector knows."""
    try:
        parse_setting(cfg.maru_copy_cpus)
        check_priority(cfg.maru_copy_priority)
    except CopyCpusError as exc:
        raise MaruConfigError(str(exc)) from None


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


def parse_config(raw: Mapping[str, Any] | None, block_size: int | None = None) -> MaruConfig:
    """Build the :class:`MaruConfig` from ``kv_connector_extra_config``.

    Args:
        raw: the extra-config dict as vLLM hands it over.
        block_size: vLLM's KV block size; when given, ``maru_kv_chunk_tokens``
            is aligned up to a multiple of it.

    Raises:
        MaruConfigError: on an unknown key (with the closest known name), a
            missing ``maru_index_url`` (optional with ``maru_sidecar_socket``),
            an ill-typed value or a conflict.
    """
    cfg = parse_knobs(raw, MaruConfig)
    _check_copy_settings(cfg)
    if block_size is not None:
        aligned = align_chunk_tokens(cfg.maru_kv_chunk_tokens, block_size)
        cfg = dataclasses.replace(cfg, maru_kv_chunk_tokens=aligned)
    return cfg


def make_kv_transfer_config(
    index_url: str | None,
    pool_path: str | None = None,
    *,
    sidecar_socket: str | None = None,
    **knobs: Any,
) -> dict[str, Any]:
    """The complete ``--kv-transfer-config`` for MaruCache, validated.

    Args:
        index_url: the index, ``tcp://HOST:PORT`` or ``unix:///PATH``; None
            with ``sidecar_socket``: the sidecar's hand-off carries it.
        pool_path: the pool file (direct attach), or
        sidecar_socket: the sidecar's Unix socket (fd hand-off).
        **knobs: further knobs, with or without their ``maru_`` prefix
            (``async_load=True`` and ``maru_async_load=True`` are the same);
            the deprecated ``use_layerwise`` is written as ``maru_format``.

    Returns:
        A dict for ``KVTransferConfig(**d)`` / ``--kv-transfer-config``; load
        failures are recomputed (``kv_load_failure_policy="recompute"``).
        The extra config holds exactly the knobs given.
    """
    extra: dict[str, Any] = {} if index_url is None else {"maru_index_url": index_url}
    if pool_path is not None:
        extra["maru_pool_path"] = str(pool_path)
    if sidecar_socket is not None:
        extra["maru_sidecar_socket"] = str(sidecar_socket)
    for key, value in knobs.items():
        extra[key if key.startswith("maru_") else f"maru_{key}"] = value
    cfg = parse_config(extra)
    names = ["maru_format" if key == "maru_use_layerwise" else key for key in extra]
    return dict(kv_transfer_config(cfg, names))
