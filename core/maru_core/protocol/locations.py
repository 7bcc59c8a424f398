"""Locations and slots, and their packed form on the wire.

A retrieve of 8,000 keys answers 8,000 locations. As msgpack arrays of
arrays they cost the client 8,000 lists to decode and 8,000 tuples to build,
more than the whole round trip may take. They travel instead as one bin of
little-endian u64 words (three per location: offset, length, generation; two
per slot: offset, generation), and the client reads them through
``LocationList`` / ``SlotList``, which build a tuple only for the item asked
for. An all-zero entry is a miss (``None``): offset 0 is the pool header,
never an object's data.
"""

from __future__ import annotations

import itertools
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Iterable, Iterator, NamedTuple, TypeVar, overload


class Location(NamedTuple):
    """Where a committed object lies: byte ``offset`` of its data from the
    start of the mapping, its ``length`` in bytes, and the ``generation`` its
    slot header must name."""

    offset: int
    length: int
    generation: int


class Slot(NamedTuple):
    """A reserved slot: write the object's data at ``offset``, then its slot
    header naming ``generation``, then commit."""

    offset: int
    generation: int


_T = TypeVar("_T", Location, Slot)


def _words_from_bytes(data: bytes | bytearray | memoryview, width: int, what: str) -> array:
    if len(data) % (8 * width):
        raise ValueError(f"packed {what} of {len(data)} bytes is not a multiple of {8 * width}")
    words = array("Q")
    words.frombytes(data)
    if sys.byteorder != "little":
        words.byteswap()
    return words


def _words_to_bytes(words: array) -> bytes:
    if sys.byteorder != "little":
        words = array("Q", words)
        words.byteswap()
    return words.tobytes()


def _pack(items: list, width: int, what: str) -> bytes:
    misses = items.count(None)
    miss = (0,) * width
    flat = itertools.chain.from_iterable(items if not misses else (miss if x is None else x for x in items))
    words = array("Q", flat)
    if len(words) != width * len(items):
        raise ValueError(f"every {what} must have {width} fields")
    if words[0::width].count(0) != misses:
        raise ValueError(f"a {what} at offset 0 cannot be told from a miss")
    return _words_to_bytes(words)


class _PackedList(Sequence):
    """A read-only sequence of ``_T | None`` over packed u64 words.

    It keeps the wire bytes it was built from (``bytes`` or a byte
    ``memoryview``, so ``to_wire`` is free) and reads them into an
    ``array('Q')`` only when an entry is first asked for.
    """

    __slots__ = ("_wire", "_array")
    _width = 1
    _type: Any = tuple  # the NamedTuple of an entry (its ``_make``)

    def __init__(self, wire: bytes | memoryview) -> None:
        self._wire = wire
        self._array: array | None = None

    @property
    def _words(self) -> array:
        if self._array is None:
            self._array = _words_from_bytes(self._wire, self._width, self._type.__name__.lower())
        return self._array

    def __len__(self) -> int:
        return len(self._wire) // (8 * self._width)

    @overload
    def __getitem__(self, index: int) -> _T | None: ...
    @overload
    def __getitem__(self, index: slice) -> list[_T | None]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} entries")
        start = index * self._width
        entry = self._words[start : start + self._width]
        return None if entry[0] == 0 else self._type._make(entry)

    def __iter__(self) -> Iterator[_T | None]:
        words, width, make = self._words, self._width, self._type._make
        for start in range(0, len(words), width):
            yield None if words[start] == 0 else make(words[start : start + width])

    def count(self, value: object) -> int:
        if value is None:
            return self.misses()
        return super().count(value)

    def __contains__(self, value: object) -> bool:
        if value is None:
            return self.misses() > 0
        return super().__contains__(value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _PackedList):
            return type(self) is type(other) and self._wire == other._wire
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"

    def misses(self) -> int:
        """How many entries are ``None``."""
        return self._words[0 :: self._width].count(0)

    def offsets(self) -> array:
        """Every entry's offset as an ``array('Q')`` (0 for a miss), without building tuples."""
        return self._words[0 :: self._width]

    def to_wire(self) -> bytes | memoryview:
        """The packed words (bytes-like: ``bytes``, or a byte ``memoryview`` of the registry's array)."""
        return self._wire

    @classmethod
    def _checked(cls, data: bytes | bytearray | memoryview, what: str):
        if len(data) % (8 * cls._width):
            raise ValueError(f"packed {what} of {len(data)} bytes is not a multiple of {8 * cls._width}")
        return cls(bytes(data))


class LocationList(_PackedList):
    """The answer of ``retrieve``: one ``Location`` or ``None`` per key, in order."""

    __slots__ = ()
    _width = 3
    _type = Location

    @classmethod
    def from_wire(cls, data: bytes | bytearray | memoryview) -> "LocationList":
        """The list over ``data`` (kept as is when it is ``bytes``: no copy)."""
        return cls._checked(data, "locations")

    @classmethod
    def from_items(cls, items: Iterable[Location | tuple | None]) -> "LocationList":
        return cls.from_wire(pack_locations(list(items)))

    def lengths(self) -> array:
        """Every entry's length in bytes (0 for a miss)."""
        return self._words[1::3]

    def generations(self) -> array:
        return self._words[2::3]


class SlotList(_PackedList):
    """The answer of ``reserve``: one ``Slot`` or ``None`` per item, in order."""

    __slots__ = ()
    _width = 2
    _type = Slot

    @classmethod
    def from_wire(cls, data: bytes | bytearray | memoryview) -> "SlotList":
        """The list over ``data`` (kept as is when it is ``bytes``: no copy)."""
        return cls._checked(data, "slots")

    @classmethod
    def from_items(cls, items: Iterable[Slot | tuple | None]) -> "SlotList":
        return cls.from_wire(pack_slots(list(items)))

    def generations(self) -> array:
        return self._words[1::2]


def pack_locations(locations: "LocationList | list") -> bytes | memoryview:
    """Pack a ``LocationList`` or ``[Location | None, ...]`` (3-tuples) into the wire form."""
    if isinstance(locations, LocationList):
        return locations.to_wire()
    return _pack(locations, 3, "location")


def pack_slots(slots: "SlotList | list") -> bytes | memoryview:
    """Pack a ``SlotList`` or ``[Slot | None, ...]`` (2-tuples) into the wire form."""
    if isinstance(slots, SlotList):
        return slots.to_wire()
    return _pack(slots, 2, "slot")
