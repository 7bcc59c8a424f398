"""A request's own choices, from its ``kv_transfer_params``: how its hit loads,
and whether what it computes is stored.

vLLM hands each request's ``kv_transfer_params`` to the connector (offline:
``SamplingParams(extra_args={"kv_transfer_params": {...}})``; the OpenAI API
server: the request body's ``kv_transfer_params``).

``{"maru_store": false}`` keeps the KV the request computes out of the pool
(a prompt the client will not share with other instances, or a one-off);
it still reads a cached prefix. Without it, or with ``true``, the engine
stores as configured. Any other value is read as ``false``, with a warning:
a store skipped costs a future miss, a store made against the client's
intent cannot be taken back.

``{"maru_load": MODE}`` picks, for that request only:

- ``"sync"``: load in the step that computes the request, and start its
  forward once every layer has landed;
- ``"overlap"``: load in that step, each layer's attention waiting only for
  its own layer (needs ``maru_overlap_load_with_compute``);
- ``"park"``: load while the request waits parked and other requests run
  (needs ``maru_async_load``).

Without it the engine's knobs decide. One engine serving the modes side by
side is how to compare them without the spread between two engine processes,
and how an operator tries a mode on live traffic without a restart. Every
mode gives the same KV, so a mode the engine was not started for, or an
unknown value, falls back to the engine's choice with a warning (through
vLLM's log, each kind at most once per ``log.REPEAT_INTERVAL_S`` with the
count of the others): the scheduler has no way to reject a request.
"""

from __future__ import annotations

from typing import Any

from .log import get_logger

logger = get_logger(__name__)

LOAD_PARAM = "maru_load"
STORE_PARAM = "maru_store"
SYNC, OVERLAP, PARK = "sync", "overlap", "park"
MODES = (SYNC, OVERLAP, PARK)


def requested_load_mode(kv_transfer_params: Any, async_load: bool, overlap: bool) -> str | None:
    """The mode a request asks for and this engine can honour; ``None``: the engine's choice.

    Args:
        kv_transfer_params: the request's ``kv_transfer_params`` (any value).
        async_load, overlap: the engine's ``maru_async_load`` and
            ``maru_overlap_load_with_compute``.
    """
    if not isinstance(kv_transfer_params, dict) or LOAD_PARAM not in kv_transfer_params:
        return None
    mode = kv_transfer_params[LOAD_PARAM]
    if mode not in MODES:
        logger.warning("MaruCache: unknown %s=%.64r in a request's kv_transfer_params: use one of %s; "
                       "the engine's own load mode is used", LOAD_PARAM, mode, ", ".join(map(repr, MODES)))
        return None
    needs = {OVERLAP: ("maru_overlap_load_with_compute", overlap), PARK: ("maru_async_load", async_load)}
    if mode in needs and not needs[mode][1]:
        logger.warning("MaruCache: %s=%r needs the engine started with %s=true; "
                       "the engine's own load mode is used", LOAD_PARAM, mode, needs[mode][0])
        return None
    return mode


def requested_store(kv_transfer_params: Any) -> bool:
    """False when the request asks that its KV not be stored (``maru_store`` false)."""
    if not isinstance(kv_transfer_params, dict) or STORE_PARAM not in kv_transfer_params:
        return True
    choice = kv_transfer_params[STORE_PARAM]
    if not isinstance(choice, bool):
        logger.warning("MaruCache: %s=%.64r in a request's kv_transfer_params is not true or false; "
                       "read as false: the request's KV is not stored", STORE_PARAM, choice)
        return False
    return choice

