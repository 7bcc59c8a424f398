"""The operations of the index protocol: the one list of their names.

The request schemas (``maru_core.protocol.messages``), the server's handlers,
the index's metrics labels and the clients all name ops through ``Op``.
"""

from __future__ import annotations

import enum


class Op(str, enum.Enum):
    """The ``op`` field of a request. A ``str`` enum: a member travels, compares
    and hashes as its name (``Op.RETRIEVE == "retrieve"``)."""

    HELLO = "hello"
    HEARTBEAT = "heartbeat"
    MATCH_PREFIX = "match_prefix"
    MATCH_PREFIXES = "match_prefixes"
    RETRIEVE = "retrieve"
    RETRIEVE_PREFIX = "retrieve_prefix"
    UNPIN = "unpin"
    RESERVE = "reserve"
    COMMIT = "commit"
    ABORT = "abort"
    STATS = "stats"
    BYE = "bye"
    # Added within protocol 1: an older index answers them ``unknown_op``.
    LIST_OBJECTS = "list_objects"
    FLUSH = "flush"
    PUT_ALIASES = "put_aliases"
    MATCH_ALIAS = "match_alias"

    def __str__(self) -> str:
        return str(self.value)


#: Every op name of this protocol version, in the order above.
OPS: tuple[str, ...] = tuple(op.value for op in Op)

#: Ops whose effect on the lease (pins, reservations) is unknown when their
#: reply is lost. If one was in flight when a connection failed, a client
#: opens a fresh lease on reconnect and lets the old one lapse, so a pin or a
#: reservation it cannot know about is released by the index, never leaked.
LEASE_STATE_OPS: frozenset[Op] = frozenset(
    {Op.RETRIEVE, Op.RETRIEVE_PREFIX, Op.UNPIN, Op.RESERVE, Op.COMMIT, Op.ABORT}
)
