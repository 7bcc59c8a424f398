"""The index client as its users see it: the operations, their results and errors.

``IndexApi`` is the seam between the index client (``IndexClient`` in
``maru_core.index.client``) and the code that calls it: the connector's
lookups, loads and stores, and the sidecar's health check. Code on the other
side of the seam is typed against ``IndexApi`` only, so a stand-in (the
connector tests' in-memory index) must implement the same methods with the
same signatures, and is checked to.

Failures are ``IndexError_`` subclasses: ``IndexUnavailable`` (unreachable,
lost connection), ``IndexTimeout`` (no answer within the timeout; also a
``TimeoutError``) and ``IndexRejected`` (an error reply, or a reply that
breaks the protocol), whose ``error_type`` is an ``ErrorType`` member.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, Union

from maru_core.protocol.errors import ErrorType
from maru_core.protocol.locations import LocationList, SlotList
from maru_core.protocol.ops import Op

if TYPE_CHECKING:
    from maru_core.pool.pool_identity import PoolIdentity

__all__ = [
    "IndexApi",
    "IndexError_",
    "IndexRejected",
    "IndexTimeout",
    "IndexUnavailable",
    "Keys",
    "MalformedReply",
    "WrongPool",
]

#: Keys as the clients take them: a sequence of 16-byte keys, or all of them
#: packed in one ``bytes`` (16 bytes each, as they travel; no join needed).
Keys = Union[Sequence[bytes], bytes]


class IndexError_(Exception):
    """Any failure of an index call. The trailing underscore keeps the
    builtin ``IndexError`` usable next to it."""


class IndexUnavailable(IndexError_):
    """The index could not be reached, or did not answer within the timeout.

    Treat it as a miss (loads) or a skipped store; the client reconnects by
    itself on a later call.
    """


class IndexTimeout(IndexUnavailable, TimeoutError):
    """The index did not answer (or accept a connection) within the timeout."""


class IndexRejected(IndexError_):
    """The index answered with an error (or with a reply that breaks the
    protocol). ``error_type`` is the protocol's error type (an ``ErrorType``
    member), ``op`` the operation refused."""

    def __init__(self, error_type: ErrorType, message: str, op: Op) -> None:
        super().__init__(f"index refused {op}: [{error_type}] {message}")
        self.error_type = ErrorType(error_type)
        self.message = message
        self.op = Op(op)


class MalformedReply(IndexRejected):
    """A reply that breaks the protocol (type ``internal``), kept in ``reply``.

    Unlike a typed error reply, the index may have carried out the request:
    a retrieve answered with the wrong number of locations may have pinned
    every key, so the clients release those pins before raising this.
    """

    def __init__(self, message: str, op: Op, reply: object = None) -> None:
        super().__init__(ErrorType.INTERNAL, message, op)
        self.reply = reply


class WrongPool(IndexRejected):
    """The index serves another pool region than the one this client mapped
    (type ``wrong_pool``, a refusal the client makes itself).

    Raised by ``hello``, so every call fails with it until the client is
    pointed at the right index: a load misses and a store is skipped, as
    with any index error; nothing is read from or written to the wrong
    memory. ``expected`` and ``served`` are the two ``PoolIdentity`` values.
    """

    def __init__(self, message: str, expected: PoolIdentity, served: PoolIdentity) -> None:
        super().__init__(ErrorType.WRONG_POOL, message, Op.HELLO)
        self.expected = expected
        self.served = served


class IndexApi(Protocol):
    """The operations of an index client that the connector and the sidecar call.

    Every call raises ``IndexUnavailable`` (``IndexTimeout`` past its
    timeout) or ``IndexRejected``; none blocks past ``timeout_s`` (or the
    call's own ``timeout_s=``).
    """

    @property
    def timeout_s(self) -> float:
        """The bound of every call that passes no ``timeout_s`` of its own."""
        ...

    def heartbeat(self) -> float:
        """Renew the lease now; return its TTL in seconds."""
        ...

    def match_prefix(self, keys: Keys, *, timeout_s: float | None = None) -> int:
        """How many leading ``keys`` are committed (pins nothing)."""
        ...

    def match_prefixes(self, key_lists: Sequence[Keys], *, timeout_s: float | None = None) -> list[int]:
        """``match_prefix`` of each list, in one round trip (pins nothing); an index
        older than this op raises ``IndexRejected`` of type ``unknown_op``."""
        ...

    def retrieve(self, keys: Keys, *, timeout_s: float | None = None) -> LocationList:
        """One location or ``None`` per key, in order; every key pinned when all
        hit, none when any misses or the call raises."""
        ...

    def retrieve_prefix(
        self, keys: Keys, group: int = 1, *, timeout_s: float | None = None
    ) -> tuple[int, LocationList | None]:
        """How many leading ``keys`` are committed, and the pinned locations of
        the first ``matched - matched % group`` of them (``None``: nothing pinned)."""
        ...

    def unpin(self, keys: Keys) -> int:
        """Release this lease's pins on ``keys``; return how many were released."""
        ...

    def reserve(self, items: Iterable[tuple[bytes, int]]) -> SlotList:
        """A slot per ``(key, length)``, or ``None`` for a key already committed or
        reserved; ``IndexRejected`` of type ``no_space`` or ``quarantined``."""
        ...

    def commit(self, keys: Keys) -> list[bool]:
        """Make reserved, written keys visible; ``False`` for a key not committed."""
        ...

    def abort(self, keys: Keys) -> int:
        """Release reservations that will not be committed; return how many."""
        ...

    def put_aliases(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store block aliases, ``(alias key, target chunk key)`` pairs; return how many
        were stored. An index older than this op raises ``IndexRejected`` of type ``unknown_op``."""
        ...

    def match_alias(self, candidates: bytes | Sequence[bytes], layers: Sequence[int] | None = None, *,
                    timeout_s: float | None = None) -> tuple[int, bytes] | None:  # fmt: skip
        """``(position, target)`` of the first of ``candidates`` whose target's objects
        (the target key; with ``layers``, its layer keys) are all committed, else
        ``None`` (pins nothing); an older index raises ``IndexRejected`` of type ``unknown_op``."""
        ...

    def close(self) -> None:
        """End the lease (releasing its pins and reservations) and disconnect."""
        ...
