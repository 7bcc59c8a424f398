"""Leases: every client of the index holds one; what it holds lapses with it.

A lease holds pins (``LeasePins``: a count per distinct object it pinned)
and owns reservations (recorded in the records' ``owner`` column by lease
number). When it lapses, both are released. It also carries what its quotas
count: the pages it holds reserved or fenced (``held_pages``), the pages it
pins (``pins.pages``) and the pages its reserves evicted lately
(``evicted``, a ``maru_core.index.quotas.EvictionWindow``). The first two
are charged to its peer's account as well, as they change (``account``,
``maru_core.index.peer_accounts``): what a peer's live leases hold is the sum
of theirs whichever way it changes.

Pins are counted once per object and lease: a second pin of an object the
lease already pins adds one to that object's count and takes no memory, so
what a lease's pins cost the index is set by how many distinct objects it
pins (bounded by its quota), never by how often it pinned them. Counts, not a
set: the connector's loads of one lease pin overlapping keys (two requests
sharing a prefix, a lookup's early pin beside a load) and each unpins what it
pinned (``maru_connector.held_pins``); a set would let the first unpin take
the pin another load still copies under. An unpin takes one count per
occurrence of a key, at most what the lease holds; the object stays pinned by
the lease until its count is zero.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator

import numpy as np

from maru_core.index.peer_accounts import PeerAccount
from maru_core.index.quotas import EvictionWindow
from maru_core.index.registry_types import run_to_end

_EMPTY = np.zeros(0, dtype=np.int64)

#: Pinned objects released per step when a lease ends (``Registry.close_lease_sliced``).
PIN_CHUNK_ROWS = 65536
#: Keys of earlier retrieves a lease remembers for a cheap unpin, as a multiple
#: of the distinct objects it pins (oldest batches forgotten first).
BATCH_MEMORY_FACTOR = 4


class SortedBatch:
    """The rows of a batch, sorted and distinct, with how often each occurs.

    Worth computing a step ahead of a pin (``Reads.retrieve_sliced``): the sort
    is most of a large batch's cost, and the rows of records that stay
    committed do not change. A stable sort (timsort) is near linear on the
    ascending runs a stored batch's rows form.
    """

    __slots__ = ("rows", "occurrences", "distinct")

    def __init__(self, rows: np.ndarray, *, presorted: bool = False) -> None:
        ordered = np.asarray(rows, dtype=np.int64)
        if not presorted:
            ordered = np.sort(ordered, kind="stable")
        if len(ordered) < 2 or bool(np.all(ordered[1:] != ordered[:-1])):
            self.rows, self.occurrences, self.distinct = ordered, np.ones(len(ordered), dtype=np.int64), True
            return
        starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
        self.rows = ordered[starts]
        self.occurrences = np.diff(np.append(starts, len(ordered)))
        self.distinct = False


class PinMerge:
    """Where a ``SortedBatch`` goes among a lease's pins: computed before the
    pin so the quota can be checked first (``LeasePins.plan``)."""

    __slots__ = ("batch", "positions", "held", "pins", "version")

    def __init__(self, batch: SortedBatch, positions: np.ndarray, held: np.ndarray, pins: LeasePins,
                 version: int) -> None:  # fmt: skip
        self.batch = batch
        self.positions = positions  # where each row is, or would go, in the lease's sorted rows
        self.held = held  # whether the lease pins it already
        self.pins, self.version = pins, version  # planned against these pins as they were at this version

    @property
    def new_rows(self) -> np.ndarray:
        """The rows the lease does not pin yet (what its quota is charged for)."""
        return self.batch.rows[~self.held]


class LeasePins:
    """The objects one lease pins: sorted distinct record rows and a count each.

    ``pages`` is kept by the registry (the pages of the distinct objects,
    what the pin quota bounds); each change of it is charged to ``account``
    (the peer's, when given). Every operation is a few vectorised passes:
    a sort of the batch, a binary search in the rows held, and an insert or
    compaction of the held arrays when objects come or go.
    """

    __slots__ = ("account", "_pages", "version", "_rows", "_counts", "_batches", "_batch_keys")

    def __init__(self, account: PeerAccount | None = None) -> None:
        self.account = account
        self._pages = 0
        self.version = 0  # changes whenever the rows held do: a plan made before is then stale
        self._rows = _EMPTY
        self._counts = _EMPTY
        # The keys of recent retrieves whose rows are distinct, joined, with
        # their sorted rows: an unpin of the same keys (the usual case) is then
        # found without a lookup. Filed under a cheap fingerprint (hashing 128 KB
        # of keys would cost more than the lookup it saves) and confirmed by
        # comparing the keys. Bounded (``BATCH_MEMORY_FACTOR``): a lease that
        # pins the same objects under ever new batches cannot grow it.
        self._batches: dict[tuple[int, bytes, bytes], tuple[bytes, np.ndarray]] = {}
        self._batch_keys = 0

    @property
    def pages(self) -> int:
        """Pages of the distinct objects pinned."""
        return self._pages

    @pages.setter
    def pages(self, pages: int) -> None:
        if self.account is not None:
            self.account.pin_pages += pages - self._pages
        self._pages = pages

    def __len__(self) -> int:
        """Distinct objects pinned."""
        return len(self._rows)

    @property
    def total(self) -> int:
        """Pins held, counting each object as often as it is pinned."""
        return int(self._counts.sum())

    @property
    def nbytes(self) -> int:
        """Memory the pins take (arrays and remembered batches), for tests and inspection."""
        batches = sum(len(keys) + rows.nbytes for keys, rows in self._batches.values())
        return self._rows.nbytes + self._counts.nbytes + batches

    @property
    def rows(self) -> np.ndarray:
        """The rows of the objects pinned, sorted (read-only: for checks and inspection)."""
        view = self._rows.view()
        view.flags.writeable = False
        return view

    def count_of(self, row: int) -> int:
        """How often this lease pins the object at ``row``."""
        i = int(np.searchsorted(self._rows, row))
        return int(self._counts[i]) if i < len(self._rows) and self._rows[i] == row else 0

    def plan(self, batch: SortedBatch) -> PinMerge:
        """Where ``batch`` goes (nothing changes until ``add``)."""
        return run_to_end(self.plan_sliced(batch, max(1, len(batch.rows))))

    def plan_sliced(self, batch: SortedBatch, slice_rows: int) -> Generator[None, None, PinMerge]:
        """``plan``, searching a slice of ``slice_rows`` of the batch's rows among the pins per
        step: a binary search per row, 0.47 ms for 20,000 rows among 20,000 pins on the 2-core
        VM in one step. The pins' rows are replaced, never changed in place, so every slice
        searches the same array; if the pins change meanwhile, the plan is stale (``still_fits``)."""
        version, pinned, wanted = self.version, self._rows, batch.rows
        positions = np.empty(len(wanted), dtype=np.int64)
        held = np.empty(len(wanted), dtype=bool)
        for start in range(0, len(wanted), slice_rows):
            if start:
                yield
            part = wanted[start : start + slice_rows]
            found = np.searchsorted(pinned, part)
            inside = found < len(pinned)
            inside[inside] = pinned[found[inside]] == part[inside]
            positions[start : start + slice_rows], held[start : start + slice_rows] = found, inside
        return PinMerge(batch, positions, held, self, version)

    def still_fits(self, merge: PinMerge) -> bool:
        """Whether ``merge`` was planned against these pins as they still are."""
        return merge.pins is self and merge.version == self.version

    def add(self, merge: PinMerge, joined_keys: bytes) -> None:
        """Pin ``merge``'s batch (planned against the pins as they still are:
        ``still_fits``); ``joined_keys`` are its keys, remembered for an unpin
        of the same batch."""
        assert self.still_fits(merge), "a pin planned against pins that changed since"
        batch, held, positions = merge.batch, merge.held, merge.positions
        if held.all():  # pinned again (no masks: they cost most of a 20,000-key re-pin)
            if len(positions) and positions[-1] - positions[0] == len(positions) - 1:
                self._counts[positions[0] : positions[-1] + 1] += batch.occurrences  # a run of the pins
            else:
                self._counts[positions] += batch.occurrences
        else:
            self._counts[positions[held]] += batch.occurrences[held]
            new = ~held
            self._rows = np.insert(self._rows, merge.positions[new], batch.rows[new])
            self._counts = np.insert(self._counts, merge.positions[new], batch.occurrences[new])
            self.version += 1
        if batch.distinct and len(batch.rows):
            self._remember(joined_keys, batch.rows)

    def _remember(self, joined_keys: bytes, rows: np.ndarray) -> None:
        fingerprint = _fingerprint(joined_keys)
        if fingerprint in self._batches:
            return  # the batch remembered first is unpinned by the fast path first
        self._batches[fingerprint] = (joined_keys, rows)
        self._batch_keys += len(rows)
        while self._batch_keys > BATCH_MEMORY_FACTOR * len(self._rows) and self._batches:
            oldest = next(iter(self._batches))  # insertion order: the oldest first
            self._batch_keys -= len(self._batches.pop(oldest)[1])

    def remembered(self, joined_keys: bytes) -> SortedBatch | None:
        """The ``SortedBatch`` of an earlier retrieve of exactly these keys that is
        still pinned (its rows cannot have changed), so a retrieve of the same
        keys again needs no sort; ``None`` when none is remembered."""
        entry = self._batches.get(_fingerprint(joined_keys))
        if entry is None or entry[0] != joined_keys:
            return None
        return SortedBatch(entry[1], presorted=True)

    def take_batch(self, joined_keys: bytes) -> tuple[int, np.ndarray] | None:
        """Unpin the objects of an earlier retrieve of exactly these keys (joined), once each:
        ``(pins dropped, rows no longer pinned)``; ``None`` when no such retrieve is remembered."""
        fingerprint = _fingerprint(joined_keys)
        entry = self._batches.get(fingerprint)
        if entry is None or entry[0] != joined_keys:
            return None
        del self._batches[fingerprint]
        rows = entry[1]
        self._batch_keys -= len(rows)
        # Every remembered batch still holds its pin on each of its rows: a
        # general unpin, which could take them, forgets every batch.
        positions = np.searchsorted(self._rows, rows)
        self._counts[positions] -= 1
        return len(rows), self._drop_zeros(positions)

    def take(self, rows: np.ndarray) -> tuple[int, np.ndarray]:
        """Drop one pin per occurrence in ``rows`` (-1: not found, ignored) of an object this
        lease pins, at most its count: ``(pins dropped, rows no longer pinned)``."""
        self._batches.clear()  # their pins may be among those taken
        self._batch_keys = 0
        rows = rows[rows >= 0]
        if not len(rows) or not len(self._rows):
            return 0, _EMPTY
        merge = self.plan(SortedBatch(rows))
        positions = merge.positions[merge.held]
        taken = np.minimum(merge.batch.occurrences[merge.held], self._counts[positions])
        self._counts[positions] -= taken
        return int(taken.sum()), self._drop_zeros(positions)

    def _drop_zeros(self, positions: np.ndarray) -> np.ndarray:
        """Forget the objects at ``positions`` whose count reached zero; return their rows."""
        zero = self._counts[positions] == 0
        if not zero.any():
            return _EMPTY
        gone = self._rows[positions[zero]]
        keep = self._counts != 0
        self._rows, self._counts = self._rows[keep], self._counts[keep]
        self.version += 1
        return gone

    def pop_all(self) -> list[np.ndarray]:
        """Every pinned object's row, once, in chunks of ``PIN_CHUNK_ROWS``; the lease then pins none."""
        rows = self._rows
        self._rows, self._counts, self.pages = _EMPTY, _EMPTY, 0
        self.version += 1
        self._batches.clear()
        self._batch_keys = 0
        return [rows[start : start + PIN_CHUNK_ROWS] for start in range(0, len(rows), PIN_CHUNK_ROWS)]


def _fingerprint(joined_keys: bytes) -> tuple[int, bytes, bytes]:
    return len(joined_keys), joined_keys[:16], joined_keys[-16:]


class Lease:
    """One client's lease. ``number`` is its compact id in the records' ``owner`` column;
    ``account`` that of the peer that opened it (kept when another peer resumes it)."""

    __slots__ = ("lease_id", "client", "number", "expires_at", "account", "_held_pages", "pins", "evicted")

    def __init__(self, lease_id: str, client: str, number: int, expires_at: float,
                 account: PeerAccount | None = None) -> None:  # fmt: skip
        self.lease_id = lease_id
        self.client = client
        self.number = number
        self.expires_at = expires_at
        self.account = account if account is not None else PeerAccount(client)
        self._held_pages = 0
        self.pins = LeasePins(self.account)
        self.evicted = EvictionWindow()  # pages its reserves evicted lately

    @property
    def held_pages(self) -> int:
        """Pool pages it holds reserved or fenced (what its quota bounds), charged to its peer too."""
        return self._held_pages

    @held_pages.setter
    def held_pages(self, pages: int) -> None:
        self.account.held_pages += pages - self._held_pages
        self._held_pages = pages


def new_lease_id() -> str:
    return uuid.uuid4().hex
