"""Typed errors of the index protocol.

Every error reply carries one of these types, so that a client can tell a
request it must change (``bad_request``, ``too_large``, ``unknown_op``) from a
state it must repair (``auth``, ``no_lease``) or a condition it may retry
later (``no_space``, ``internal``).
"""

from __future__ import annotations

import enum


class ErrorType(str, enum.Enum):
    """The ``error.type`` field of an error reply."""

    BAD_REQUEST = "bad_request"  # a field is missing, of the wrong type or out of range
    UNKNOWN_OP = "unknown_op"  # the ``op`` names no operation of this protocol version
    AUTH = "auth"  # ``hello`` carried a wrong or missing token
    TOO_LARGE = "too_large"  # a batch or frame above the protocol's limits
    NO_LEASE = "no_lease"  # the connection holds no live lease: send ``hello`` again
    NO_SPACE = "no_space"  # the pool cannot hold what was reserved, even after eviction
    # the index restarted over a pool in use and hands out no slot until copies
    # in flight across the restart are done (a lease period): stores are skipped
    QUARANTINED = "quarantined"
    # the lease holds its quota of pool pages (reserved, or fenced after a lapse):
    # it must commit or abort what it holds first
    QUOTA = "quota"
    INTERNAL = "internal"  # the server failed; the request may be retried
    # raised by a client itself, never sent by an index: the index serves
    # another pool region than the one the client mapped
    WRONG_POOL = "wrong_pool"

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def of_reply(cls, wire_type: object) -> ErrorType:
        """The type of an error reply; ``INTERNAL`` for one this version does not
        know (a newer index's): the most cautious reading, since an ``internal``
        refusal may have carried out part of the request."""
        if isinstance(wire_type, str):
            try:
                return cls(wire_type)
            except ValueError:
                pass
        return cls.INTERNAL


#: The types an index sends in error replies (all but the clients' own).
REPLY_ERROR_TYPES: tuple[ErrorType, ...] = tuple(t for t in ErrorType if t is not ErrorType.WRONG_POOL)


class ProtocolError(Exception):
    """A request the server refuses with a typed error reply.

    ``error_type`` goes to the reply's ``error.type`` and ``str(self)`` to
    ``error.message``; the message says what the sender must change.
    """

    def __init__(self, error_type: ErrorType, message: str) -> None:
        super().__init__(message)
        self.error_type = ErrorType(error_type)

    @property
    def message(self) -> str:
        return str(self)

    def to_wire(self) -> dict[str, str]:
        return {"type": self.error_type.value, "message": self.message}


class FrameError(Exception):
    """A byte stream that is not a sequence of valid frames.

    The receiver cannot find the next frame boundary it can trust, so it
    closes the connection (only that one).
    """


class FrameTooLarge(FrameError):
    """A frame announces a payload above ``MAX_FRAME_BYTES``; the receiver
    answers ``too_large`` before closing."""
