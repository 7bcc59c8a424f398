"""The connector's configuration checked before vLLM loads the model, and the start-up line.

vLLM builds the connector itself only once the model is loaded and its KV
cache sized (a minute or more on a large model), so a typo in a ``maru_`` key
or a wrong token found there costs that minute. vLLM asks the connector's
class a few questions earlier, with ``kv_connector_extra_config`` in hand,
while it resolves its configuration in the process that starts the engine:
``kv_cache_access`` (vLLM 0.34 on, always) and
``requires_piecewise_for_cudagraph`` (whenever CUDA graphs are on, the GPU
default); vLLM 0.32 without CUDA graphs asks first with
``get_required_kvcache_layout``, after the weights but before the KV cache
is sized. Each runs :func:`check_before_load` (connector.py): the knobs
parsed strictly, the token file read and, with a sidecar, the hand-off asked
for once (a wrong token, cache name or version is refused there; the
descriptor is closed at once), whose index address must agree with an
explicit ``maru_index_url``. A sidecar that does not answer yet is no error:
the containers of a pod start in any order, and the connector asks again
when it starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maru_connector.config import MaruConfig, MaruConfigError, parse_config
from maru_connector.log import get_logger

if TYPE_CHECKING:
    from maru_core.pool.pool_identity import PoolIdentity

logger = get_logger(__name__)

#: How long the check waits for a sidecar that does not answer yet.
SIDECAR_WAIT_S = 5.0

# What to change for each refusal type of the hand-off (maru_core.handoff.ERROR_TYPES).
_REFUSAL_FIXES = {
    "auth": "set maru_token or maru_token_file to the cache's token (the one its sidecar was started with) or to "
            "the pod credential the sidecar writes (--credential-file)",
    "wrong_cache": "set maru_cache_name to the name of the cache this sidecar serves",
    "protocol": "run the same MaruCache version in the vLLM and sidecar containers",
}


@dataclass(frozen=True)
class Checked:
    """What the check found: the knobs, and where the pool and index are when it could tell."""

    cfg: MaruConfig
    index_url: str | None  # None: a sidecar that did not answer yet will tell
    pool: "PoolIdentity | None"  # None: not readable yet (see the warning logged)


_checked: dict[str, Checked] = {}  # one check per configuration and process


def check_before_load(extra_config: Mapping[str, Any] | None) -> Checked:
    """Check ``kv_connector_extra_config`` as far as can be done without the model.

    Raises:
        MaruConfigError: an unknown or ill-typed knob, an unreadable token
            file, a hand-off the sidecar refuses, or an index address that
            differs from the sidecar's; the message says what to change.
    """
    key = json.dumps(dict(extra_config or {}), sort_keys=True, default=str)
    if key not in _checked:
        _checked[key] = _check(parse_config(extra_config))
    return _checked[key]


def _check(cfg: MaruConfig) -> Checked:
    try:
        token = cfg.resolve_token()
    except MaruConfigError:
        if not _sidecar_not_up(cfg):
            raise
        # The pod credential its sidecar writes before serving its socket: both come later.
        logger.warning("MaruCache: neither maru_token_file=%s nor the sidecar's socket exist yet; the connector "
                       "asks again when it starts", cfg.maru_token_file)
        return Checked(cfg, cfg.maru_index_url, None)
    if cfg.maru_sidecar_socket is None:
        return Checked(cfg, cfg.resolve_index_url(), _read_pool_file(cfg))
    from maru_core.handoff import HandoffProtocolError, HandoffRefused, HandoffUnavailable, fetch_pool

    try:
        handoff = fetch_pool(cfg.maru_sidecar_socket, token, cfg.maru_cache_name, timeout_s=SIDECAR_WAIT_S)
    except HandoffRefused as exc:
        raise MaruConfigError(f"{exc}: {_REFUSAL_FIXES.get(exc.type, 'see the sidecar log')}") from None
    except HandoffProtocolError as exc:
        raise MaruConfigError(f"{exc}: point maru_sidecar_socket at the MaruCache sidecar's socket") from None
    except HandoffUnavailable as exc:
        logger.warning("MaruCache: %s; the connector asks again when it starts", exc)
        return Checked(cfg, cfg.maru_index_url, None)
    os.close(handoff.fd)
    return Checked(cfg, cfg.resolve_index_url(handoff.index_url), handoff.pool_identity())


def _sidecar_not_up(cfg: MaruConfig) -> bool:
    """A sidecar is configured whose socket does not exist, and the token file is missing too."""
    return (cfg.maru_sidecar_socket is not None and not os.path.exists(cfg.maru_sidecar_socket)
            and cfg.maru_token_file is not None and not os.path.exists(cfg.maru_token_file))


def _read_pool_file(cfg: MaruConfig) -> "PoolIdentity | None":
    from maru_core.pool import PoolError
    from maru_core.pool.pool_identity import PoolIdentity

    assert cfg.maru_pool_path is not None, "parse_config sets exactly one of the two"
    try:
        return PoolIdentity.read(cfg.maru_pool_path)
    except (OSError, PoolError) as exc:  # created later, e.g. by an index that starts after this engine
        logger.warning("MaruCache: the pool at maru_pool_path=%s cannot be read yet (%s)", cfg.maru_pool_path, exc)
        return None


def startup_line(role: str, checked: Checked) -> str:
    """One line saying what the connector does, for the log at start-up (once per engine role)."""
    cfg, pool = checked.cfg, checked.pool
    where = (f"sidecar socket {cfg.maru_sidecar_socket}" if cfg.maru_sidecar_socket is not None
             else f"pool file {cfg.maru_pool_path}")
    if pool is not None:
        where += f" (pool {pool.uuid}, {pool.size / (1 << 30):.2f} GiB at offset {pool.offset or 0})"
    if checked.index_url is None:
        index = "the one the sidecar's hand-off names"
    else:
        index = checked.index_url + (" (the sidecar's)" if cfg.maru_index_url is None else "")
    load = "parked while other requests run" if cfg.maru_async_load else "in the step that computes it"
    verify = {None: "on (default)", True: "on", False: "off"}[cfg.maru_verify_payload]
    return (f"MaruCache connector ({role}): cache {cfg.maru_cache_name!r}, {where}, index {index}, "
            f"format {cfg.fmt_name} in {cfg.maru_kv_chunk_tokens}-token chunks, hits load {load}, "
            f"overlap with compute {'on' if cfg.maru_overlap_load_with_compute else 'off'}, "
            f"payload verification {verify}, stores {'async' if cfg.maru_async_store else 'sync'}")
