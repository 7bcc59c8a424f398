"""An in-memory stand-in for ``maru_core.index.client.IndexClient`` (unit tests only).

It keeps the index's rules that the connector relies on — write-once commit,
all-or-nothing pinned retrieve, one location per key in order, reserve that
skips committed or reserved keys — over a bump allocator on a real pool's
geometry, and lets a test inject the faults the connector must survive:
short or long replies, an unreachable index, a slow index, a full pool.

It raises what the real client raises (``IndexUnavailable``, and
``IndexRejected`` with the protocol's ``error_type``) and answers with the
real protocol types (``LocationList``, ``SlotList``), so code that reads a
field the real types lack fails here too. ``FakeClient`` implements
``maru_core.index.api.IndexApi``, the seam the connector is typed against;
``test_fake_index_conforms.py`` type-checks that it still does.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from maru_core.index.api import IndexRejected, IndexUnavailable, Keys
from maru_core.keys import packed_layer_keys
from maru_core.pool.commit_records import CommitRecords
from maru_core.protocol import ErrorType, Location, LocationList, Op, Slot, SlotList
from maru_core.protocol.messages import unpack_keys

__all__ = ["FakeClient", "FakeIndex", "Location", "Slot"]


class FakeIndex:
    """Shared state of one fake index; ``client()`` gives a client of it.

    With ``pool``, a commit marks the committed objects' slot headers
    committed, as the real index does (a reader refuses any other)."""

    def __init__(self, geometry: Any, pool: Any = None) -> None:
        self._geometry = geometry
        self._record = CommitRecords(pool) if pool is not None else None
        self._next_page = 0
        self.lock = threading.Lock()
        self.committed: dict[bytes, Location] = {}
        self.reserved: dict[bytes, Location] = {}
        self.pins: Counter[bytes] = Counter()
        self.aliases: dict[bytes, bytes] = {}  # block alias -> target chunk key (no capacity)
        self.calls: Counter[str] = Counter()
        self.down = False
        self.delay_s = 0.0
        # locations -> locations (fault injection), retrieve_prefix's too
        self.retrieve_hook: Callable[[list[Location | None]], list[Location | None]] | None = None
        self.knows_retrieve_prefix = True  # False: answers it as an older index would (unknown op)
        self.knows_match_prefixes = True  # likewise
        self.knows_aliases = True  # likewise for put_aliases and match_alias
        self.quarantined = False  # True: refuses reserves as a restarted index does
        self.unpin_gate: threading.Event | None = None  # unpins wait until it is set (10 s at most)

    def client(self, *args: Any, **kwargs: Any) -> "FakeClient":
        return FakeClient(self)

    def _enter(self, op: str) -> None:
        self.calls[op] += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.down:
            raise IndexUnavailable(f"index unreachable ({op})")

    def _allocate(self, length: int) -> Location | None:
        g = self._geometry
        pages = -(-length // g.page_size)
        if self._next_page + pages > g.num_pages:
            return None
        offset = g.data_offset + self._next_page * g.page_size
        self._next_page += pages
        return Location(offset, length, self._next_page)


def _keys(keys: Keys) -> list[bytes]:
    """Keys as a list, from a list or packed end to end (the real client takes both)."""
    return list(unpack_keys(keys)) if isinstance(keys, bytes) else list(keys)


class FakeClient:
    """A client of a ``FakeIndex``: an ``IndexApi``, as ``IndexClient`` is."""

    #: What the connector reads as the client's call timeout (a test may patch it).
    timeout_s: float = 1.0

    def __init__(self, index: FakeIndex) -> None:
        self._ix = index
        self.closed = False

    def heartbeat(self) -> float:
        self._ix._enter("heartbeat")
        return 3.0

    def match_prefix(self, keys: Keys, *, timeout_s: float | None = None) -> int:
        self._ix._enter("match_prefix")
        with self._ix.lock:
            return self._leading_committed(_keys(keys))

    def match_prefixes(self, key_lists: Sequence[Keys], *, timeout_s: float | None = None) -> list[int]:
        self._ix._enter("match_prefixes")
        if not self._ix.knows_match_prefixes:
            raise IndexRejected(ErrorType.UNKNOWN_OP, "unknown op 'match_prefixes'", Op.MATCH_PREFIXES)
        with self._ix.lock:
            return [self._leading_committed(_keys(keys)) for keys in key_lists]

    def _leading_committed(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are committed (the caller holds the lock)."""
        n = 0
        while n < len(keys) and keys[n] in self._ix.committed:
            n += 1
        return n

    def retrieve(self, keys: Keys, *, timeout_s: float | None = None) -> LocationList:
        self._ix._enter("retrieve")
        listed = _keys(keys)
        with self._ix.lock:
            locations = [self._ix.committed.get(k) for k in listed]
            if all(loc is not None for loc in locations):
                self._ix.pins.update(listed)
        if self._ix.retrieve_hook is not None:
            locations = self._ix.retrieve_hook(locations)
        return LocationList.from_items(locations)

    def retrieve_prefix(
        self, keys: Keys, group: int = 1, *, timeout_s: float | None = None
    ) -> tuple[int, LocationList | None]:
        """Match, then pin the matched whole groups; a reply the hook spoils is
        rejected as the real client rejects it, with nothing left pinned."""
        self._ix._enter("retrieve_prefix")
        if not self._ix.knows_retrieve_prefix:
            raise IndexRejected(ErrorType.UNKNOWN_OP, "unknown op 'retrieve_prefix'", Op.RETRIEVE_PREFIX)
        listed = _keys(keys)
        with self._ix.lock:
            matched = self._leading_committed(listed)
            pinned = listed[: matched - matched % group]
            locations: list[Location | None] = [self._ix.committed[k] for k in pinned]
            self._ix.pins.update(pinned)
        if not pinned:
            return matched, None
        if self._ix.retrieve_hook is not None:
            locations = self._ix.retrieve_hook(locations)
        if len(locations) != len(pinned) or None in locations:
            with self._ix.lock:
                self._ix.pins.subtract(pinned)  # the real client lets its lease lapse
                self._ix.pins = +self._ix.pins
            raise IndexRejected(ErrorType.INTERNAL, f"malformed reply: {len(locations)} locations "
                                f"(misses included) for {len(pinned)} pinned keys", Op.RETRIEVE_PREFIX)
        return matched, LocationList.from_items(locations)

    def unpin(self, keys: Keys) -> int:
        self._ix._enter("unpin")
        if self._ix.unpin_gate is not None:
            self._ix.unpin_gate.wait(10.0)
        with self._ix.lock:
            n = 0
            for key in _keys(keys):
                if self._ix.pins[key] > 0:
                    self._ix.pins[key] -= 1
                    n += 1
            self._ix.pins = +self._ix.pins
            return n

    def reserve(self, items: Iterable[tuple[bytes, int]]) -> SlotList:
        """Like the index: ``None`` for a key already known or that does not fit,
        ``IndexRejected`` of type ``no_space`` when no new key fits, of type
        ``quarantined`` while ``quarantined``."""
        self._ix._enter("reserve")
        if self._ix.quarantined:
            raise IndexRejected(ErrorType.QUARANTINED, "the fake index restarted", Op.RESERVE)
        slots: list[Slot | None | bool] = []  # False: no room for this key
        with self._ix.lock:
            for key, length in items:
                known = key in self._ix.committed or key in self._ix.reserved
                loc = None if known else self._ix._allocate(length)
                if loc is not None:
                    self._ix.reserved[key] = loc
                    slots.append(Slot(loc.offset, loc.generation))
                elif known:
                    slots.append(None)
                else:
                    slots.append(False)
        if False in slots and not any(slots):
            raise IndexRejected(ErrorType.NO_SPACE, "no room in the fake pool", Op.RESERVE)
        return SlotList.from_items([slot if isinstance(slot, Slot) else None for slot in slots])

    def commit(self, keys: Keys) -> list[bool]:
        self._ix._enter("commit")
        with self._ix.lock:
            done = []
            for key in _keys(keys):
                loc = self._ix.reserved.pop(key, None)
                ok = loc is not None and key not in self._ix.committed
                if loc is not None and ok:
                    self._ix.committed[key] = loc
                    if self._ix._record is not None:
                        self._ix._record(np.array([loc.offset], dtype=np.int64))
                done.append(ok)
            return done

    def abort(self, keys: Keys) -> int:
        self._ix._enter("abort")
        with self._ix.lock:
            return sum(self._ix.reserved.pop(k, None) is not None for k in _keys(keys))

    def put_aliases(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        self._ix._enter("put_aliases")
        if not self._ix.knows_aliases:
            raise IndexRejected(ErrorType.UNKNOWN_OP, "unknown op 'put_aliases'", Op.PUT_ALIASES)
        with self._ix.lock:
            self._ix.aliases.update(items)
            return len(items)

    def match_alias(self, candidates: bytes | Sequence[bytes], layers: Sequence[int] | None = None, *,
                    timeout_s: float | None = None) -> tuple[int, bytes] | None:  # fmt: skip
        """As the index: the first candidate whose target's objects are all committed."""
        self._ix._enter("match_alias")
        if not self._ix.knows_aliases:
            raise IndexRejected(ErrorType.UNKNOWN_OP, "unknown op 'match_alias'", Op.MATCH_ALIAS)
        with self._ix.lock:
            for position, alias in enumerate(_keys(candidates)):
                target = self._ix.aliases.get(alias)
                if target is None:
                    continue
                objects = [target] if layers is None else _keys(packed_layer_keys(target, layers))
                if all(key in self._ix.committed for key in objects):
                    return position, target
        return None

    def close(self) -> None:
        self.closed = True
