"""Pins a lease holds, and how they are given back: the bookkeeping the load
path (``resolve``) and the lookup's early pins (``early_pins``) share, and
the failure a load ends with (``LoadFailure``)."""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

from maru_core.index.api import IndexApi, Keys
from maru_core.keys import Key, split_keys

from .log import get_logger

logger = get_logger(__name__)


class LoadFailure(Exception):
    """A load that cannot go ahead; ``reason`` is a metric label value."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def index_failure(exc: BaseException) -> LoadFailure:
    """The ``LoadFailure`` of a retrieve that raised ``exc``: ``timeout`` for the
    index client's ``IndexTimeout`` (any ``TimeoutError``), else ``index_error``."""
    reason = "timeout" if isinstance(exc, TimeoutError) else "index_error"
    return LoadFailure(reason, f"{type(exc).__name__}: {exc}")


class PinHolder(Protocol):
    """What holds pins of a lease: a load's own (``resolve.PinnedLoad``) or a
    lookup's (``early_pins.EarlyPin``): the object keys it pinned, packed."""

    @property
    def object_keys(self) -> bytes: ...


_Holder = PinHolder


class _HeldPins:
    """Per index client (one lease), the keys each of its loads in flight pinned.

    The index counts pins per lease and key, so an unpin by a load that did
    not pin would take a pin another load of the same lease still copies
    under. Only keys no load in flight holds may be unpinned on a guess.
    Loads are recorded whole (adding and removing one costs the same for
    2,048 keys as for one); only that rare guess looks at the keys.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_client: weakref.WeakKeyDictionary[IndexApi, dict[int, _Holder]] = weakref.WeakKeyDictionary()

    def add(self, client: IndexApi, load: _Holder) -> None:
        with self._lock:
            self._by_client.setdefault(client, {})[id(load)] = load

    def remove(self, client: IndexApi, load: _Holder) -> None:
        with self._lock:
            self._by_client.get(client, {}).pop(id(load), None)

    def not_held(self, client: IndexApi, keys: bytes) -> list[Key]:
        """Of ``keys`` (packed), those no load of ``client`` in flight pinned."""
        with self._lock:
            loads = list(self._by_client.get(client, {}).values())
        held = {key for load in loads for key in split_keys(load.object_keys)}
        return [k for k in split_keys(keys) if k not in held]


_HELD = _HeldPins()


def hold(client: IndexApi, load: _Holder) -> None:
    """Record that ``load`` (a ``PinnedLoad`` or an ``EarlyPin``) holds pins of ``client``'s lease."""
    _HELD.add(client, load)


def forget_held(client: IndexApi, load: _Holder) -> None:
    _HELD.remove(client, load)


def unpin_hidden(client: IndexApi, keys: bytes) -> None:
    """After a reply with a miss (which pins nothing): give back the pins a
    reply altered on the way may hide, except those another load holds."""
    unpin_quietly(client, _HELD.not_held(client, keys))


def unpin_quietly(client: IndexApi, keys: Keys) -> None:
    try:
        client.unpin(keys)
    except Exception as exc:  # the lease releases the pins if this fails
        logger.warning("unpin of %d keys failed (%s); the lease will release them", len(keys), exc)
