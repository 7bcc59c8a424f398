"""What the sync and async index clients share: errors, request builders,
reply checks, and the lease policy on reconnect.

Every reply is checked before it is handed out: a retrieve that answers a
different number of locations than keys were asked, or a reply of the wrong
shape, raises ``IndexRejected`` instead of being sliced by position.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    from maru_core.pool.pool_identity import PoolIdentity

from maru_core.protocol import (
    KEY_BYTES,
    PROTOCOL_VERSION,
    ErrorType,
    LocationList,
    MAX_BATCH_KEYS,
    SlotList,
    pack_counts,
    pack_keys,
    pack_lengths,
)

#: Ops whose effect on the lease (pins, reservations) is unknown when their
#: reply is lost. If one was in flight when a connection failed, the client
#: opens a fresh lease on reconnect and lets the old one lapse, so a pin or a
#: reservation it cannot know about is released by the index, never leaked.
LEASE_STATE_OPS = frozenset({"retrieve", "retrieve_prefix", "unpin", "reserve", "commit", "abort"})

#: Keys as the clients take them: a sequence of 16-byte keys, or all of them
#: packed in one ``bytes`` (16 bytes each, as they travel; no join needed).
Keys = Sequence[bytes] | bytes

DEFAULT_TIMEOUT_S = 5.0
#: After a failed connect, calls fail fast for this long instead of each
#: waiting for a connect timeout; the heartbeat keeps trying meanwhile.
DEFAULT_RECONNECT_BACKOFF_S = 0.5


class IndexError_(Exception):
    """Any failure of an index call. The trailing underscore keeps the
    builtin ``IndexError`` usable next to it."""


class IndexUnavailable(IndexError_):
    """The index could not be reached, or did not answer within the timeout.

    Treat it as a miss (loads) or a skipped store; the client reconnects by
    itself on a later call.
    """


class IndexRejected(IndexError_):
    """The index answered with an error (or with a reply that breaks the
    protocol). ``error_type`` is the protocol's error type (an ``ErrorType``
    value), ``op`` the operation refused."""

    def __init__(self, error_type: str, message: str, op: str) -> None:
        super().__init__(f"index refused {op}: [{error_type}] {message}")
        self.error_type = error_type
        self.message = message
        self.op = op


class MalformedReply(IndexRejected):
    """A reply that breaks the protocol (type ``internal``), kept in ``reply``.

    Unlike a typed error reply, the index may have carried out the request:
    a retrieve answered with the wrong number of locations may have pinned
    every key, so the clients release those pins before raising this.
    """

    def __init__(self, message: str, op: str, reply: Any = None) -> None:
        super().__init__(ErrorType.INTERNAL.value, message, op)
        self.reply = reply


#: ``error_type`` of ``WrongPool``: a refusal made by the client itself, never sent by an index.
WRONG_POOL = "wrong_pool"


class WrongPool(IndexRejected):
    """The index serves another pool region than the one this client mapped.

    Raised by ``hello``, so every call fails with it until the client is
    pointed at the right index: a load misses and a store is skipped, as
    with any index error; nothing is read from or written to the wrong
    memory. ``expected`` and ``served`` are the two ``PoolIdentity`` values.
    """

    def __init__(self, message: str, expected: PoolIdentity, served: PoolIdentity) -> None:
        super().__init__(WRONG_POOL, message, "hello")
        self.expected = expected
        self.served = served


def check_served_pool(expected: PoolIdentity | None, reply: dict[str, Any], url: str) -> None:
    """Raise ``WrongPool`` unless the ``hello`` ``reply`` of the index at ``url``
    names the pool region ``expected`` (a ``PoolIdentity``) describes."""
    from maru_core.pool.pool_identity import PoolIdentity

    try:
        served = PoolIdentity.from_hello(reply)
    except ValueError as exc:
        raise _broken("hello", f"the pool it serves: {exc}", reply) from exc
    differ = expected.mismatch(served)
    if differ is not None:
        raise WrongPool(
            f"the index at {url} serves {served.describe()}, but this process mapped {expected.describe()} "
            f"({differ} differ): refusing it, so nothing is read from or written to another region. "
            "The cache was probably moved or resized, or the index URL names another cache's index: "
            "re-create this pod (e.g. kubectl rollout restart) so it maps the cache's current region",
            expected,
            served,
        )


def while_backing_off(last_error: IndexError_) -> IndexError_:
    """What a call fails with while the client waits to reconnect after ``last_error``:
    the same refusal for a wrong pool (only another index or pod cures it), else ``IndexUnavailable``."""
    if isinstance(last_error, WrongPool):
        return WrongPool(last_error.message, last_error.expected, last_error.served)
    return IndexUnavailable(f"{last_error} (retrying in the background)")


def default_client_name() -> str:
    """A readable client name; identity comes from the lease, not from this."""
    return f"{socket.gethostname()}/{os.getpid()}"


def hello_request(client_name: str, token: str | None, lease_id: str | None) -> dict[str, Any]:
    return {
        "op": "hello",
        "protocol": PROTOCOL_VERSION,
        "client": client_name,
        "token": token,
        "lease_id": lease_id,
    }


def keys_request(op: str, keys: Keys) -> dict[str, Any]:
    """A request carrying ``keys`` packed (see ``maru_core.protocol.messages``);
    ``keys`` may already be packed (one ``bytes`` of 16-byte keys end to end)."""
    return {"op": op, "keys": pack_keys(keys)}


def prefix_request(keys: Keys, group: int) -> dict[str, Any]:
    """A ``retrieve_prefix`` request: ``keys`` packed, pinned in whole groups of ``group``."""
    if type(group) is not int or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    return {"op": "retrieve_prefix", "keys": pack_keys(keys), "group": group}


def prefixes_requests(key_lists: Sequence[Keys]) -> list[dict[str, Any]]:
    """``match_prefixes`` requests for ``key_lists``: one, or as many as keep
    each within ``MAX_BATCH_KEYS`` keys (a list alone larger than that is
    still sent alone: the index names the limit)."""
    requests, packed, counts, total = [], [], [], 0
    for keys in key_lists:
        keys = pack_keys(keys)
        if counts and total + len(keys) // KEY_BYTES > MAX_BATCH_KEYS:
            requests.append({"op": "match_prefixes", "keys": b"".join(packed), "counts": pack_counts(counts)})
            packed, counts, total = [], [], 0
        packed.append(keys)
        counts.append(len(keys) // KEY_BYTES)
        total += counts[-1]
    if counts:
        requests.append({"op": "match_prefixes", "keys": b"".join(packed), "counts": pack_counts(counts)})
    return requests


def parse_prefixes(reply: dict, request: dict[str, Any]) -> list[int]:
    """A ``match_prefixes`` reply: one count per list asked, none above its list's length."""
    op = "match_prefixes"
    counts = np.frombuffer(request["counts"], dtype="<i8").tolist()
    matched = _field(op, reply, "matched", list)
    if len(matched) != len(counts) or any(type(m) is not int or not 0 <= m <= c for m, c in zip(matched, counts)):
        raise _broken(op, f"matched={str(matched)[:100]} for lists of {str(counts)[:100]} keys", reply)
    return matched


def reserve_request(items: Iterable[tuple[bytes, int]]) -> dict[str, Any]:
    """A reserve request with its keys and lengths packed."""
    items = list(items)
    keys = [k for k, _ in items]
    lengths = [n for _, n in items]
    return {"op": "reserve", "keys": pack_keys(keys), "lengths": pack_lengths(lengths)}


def request_size(request: dict[str, Any]) -> int:
    """How many keys a request built here carries."""
    return len(request["keys"]) // KEY_BYTES


def _broken(op: str, what: str, reply: Any = None) -> MalformedReply:
    return MalformedReply(f"malformed reply: {what}", op, reply)


def check_reply(op: str, reply: Any) -> dict[str, Any]:
    """The reply map of a successful call; raise ``IndexRejected`` for an error reply."""
    if type(reply) is not dict or "ok" not in reply:
        raise _broken(op, "not a reply map", reply)
    if reply["ok"] is True:
        return reply
    error = reply.get("error")
    if type(error) is not dict:
        raise _broken(op, "error reply without an error map", reply)
    raise IndexRejected(str(error.get("type")), str(error.get("message")), op)


def _field(op: str, reply: dict, name: str, kind: type) -> Any:
    value = reply.get(name)
    if type(value) is not kind:
        raise _broken(op, f"field {name!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def parse_count(op: str, reply: dict, name: str, at_most: int) -> int:
    value = _field(op, reply, name, int)
    if not 0 <= value <= at_most:
        raise _broken(op, f"{name}={value} for {at_most} keys")
    return value


def parse_locations(reply: dict, count: int) -> LocationList:
    try:
        locations = LocationList.from_wire(_field("retrieve", reply, "locations", bytes))
    except MalformedReply as exc:
        exc.reply = reply
        raise
    except ValueError as exc:
        raise _broken("retrieve", str(exc), reply) from exc
    if len(locations) != count:
        raise _broken("retrieve", f"{len(locations)} locations for {count} keys", reply)
    return locations


def parse_prefix(reply: dict, count: int, group: int) -> tuple[int, LocationList | None]:
    """A ``retrieve_prefix`` reply: ``(matched, locations)``, the locations
    (``None``: nothing pinned) exactly the pinned whole groups, none a miss."""
    op = "retrieve_prefix"
    try:
        matched = parse_count(op, reply, "matched", count)
        wire = _field(op, reply, "locations", bytes)
        if not wire:
            return matched, None
        locations = LocationList.from_wire(wire)
        pinned = matched - matched % group
        if len(locations) != pinned or None in locations:
            raise _broken(op, f"{len(locations)} locations (misses included) for {pinned} pinned keys "
                          f"of {matched} matched in groups of {group}")
    except MalformedReply as exc:
        exc.reply = reply
        raise
    except ValueError as exc:
        raise _broken(op, str(exc), reply) from exc
    return matched, locations


def rejected_prefix_pinned(exc: IndexRejected) -> bool | None:
    """Whether a ``retrieve_prefix`` that raised ``exc`` may have pinned anything.

    ``False``: a typed refusal, or a reply with no locations (the index pins
    only what it returns). ``None``: it cannot be told; the lease must end.
    Unlike a retrieve's, such a reply is never unpinned on its word: its
    count of pinned keys is what failed the check.
    """
    if not isinstance(exc, MalformedReply):
        return None if exc.error_type == ErrorType.INTERNAL.value else False
    reply = exc.reply
    if type(reply) is dict and reply.get("ok") is True and reply.get("locations") == b"":
        return False
    return None


def rejected_retrieve_pinned(exc: IndexRejected, count: int) -> bool | None:
    """Whether the index pinned the ``count`` keys of a retrieve that raised ``exc``.

    ``False``: a typed refusal (retrieve pins nothing before it can refuse).
    For a malformed reply marked ``ok`` whose locations decode to at least
    ``count`` entries, the first ``count`` are the index's answer: ``True``
    when none is a miss (every key hit, so every key was pinned), ``False``
    otherwise (all or nothing). ``None``: it cannot be told (an ``internal``
    error, no proper reply map, locations that do not decode, fewer entries
    than keys, the lost ones possibly misses); only ending the lease is safe
    then, because unpinning keys that this retrieve did not pin would drop
    pins that other retrieves on the same lease still hold.
    """
    if not isinstance(exc, MalformedReply):
        return None if exc.error_type == ErrorType.INTERNAL.value else False
    reply = exc.reply
    if type(reply) is not dict or reply.get("ok") is not True:
        return None
    try:
        locations = LocationList.from_wire(reply.get("locations"))
    except (TypeError, ValueError):
        return None
    if len(locations) < count:
        return None
    return None not in locations[:count]


def parse_slots(reply: dict, count: int) -> SlotList:
    try:
        slots = SlotList.from_wire(_field("reserve", reply, "slots", bytes))
    except ValueError as exc:
        raise _broken("reserve", str(exc)) from exc
    if len(slots) != count:
        raise _broken("reserve", f"{len(slots)} slots for {count} items")
    return slots


def parse_committed(reply: dict, count: int) -> list[bool]:
    committed = _field("commit", reply, "committed", list)
    if len(committed) != count or set(map(type, committed)) - {bool}:
        raise _broken("commit", f"'committed' must be {count} booleans")
    return committed


def parse_hello(reply: dict) -> tuple[str, float, dict[str, Any]]:
    lease_id = _field("hello", reply, "lease_id", str)
    ttl = reply.get("lease_ttl_s")
    if type(ttl) not in (int, float) or ttl <= 0:
        raise _broken("hello", "lease_ttl_s must be a positive number")
    return lease_id, float(ttl), _field("hello", reply, "geometry", dict)
