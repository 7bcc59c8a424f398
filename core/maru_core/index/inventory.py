"""The wire side of ``list_objects`` and ``flush`` for clients: requests, and
replies checked into plain records (``maru_core.index.object_ops`` is the
index's side; ``docs/architecture.md``, Index protocol, the fields)."""

from __future__ import annotations

import dataclasses

from maru_core.index.api import MalformedReply
from maru_core.protocol import Message, Op
from maru_core.protocol.messages import MAX_SCAN_ROWS, OBJECT_FORMATS

#: Rows a client asks the index to scan per request by default.
DEFAULT_SCAN_ROWS = 16384
_U64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class ObjectGroup:
    """Committed objects of one layout fingerprint and storage format: how many, their
    pool pages, their bytes and how many of them are pinned."""

    layout: int
    format: str
    objects: int
    pages: int
    bytes: int
    pinned: int


@dataclasses.dataclass(frozen=True)
class ObjectsPage:
    """One ``list_objects`` reply: the groups of a range of rows, and where the next range starts
    (``None``: the listing is complete)."""

    groups: tuple[ObjectGroup, ...]
    next_cursor: int | None


@dataclasses.dataclass(frozen=True)
class FlushPage:
    """One ``flush`` reply: objects and bytes evicted, pinned objects skipped, objects an
    eviction window held back (``quota`` names it; send the request again, from
    ``next_cursor``, after ``retry_after_s``), and where the next range starts (``None``: done)."""

    evicted: int
    evicted_bytes: int
    pinned: int
    held_back: int
    quota: str | None
    retry_after_s: float
    next_cursor: int | None


def _check_scan(cursor: int, limit: int) -> None:
    if type(cursor) is not int or cursor < 0:
        raise ValueError(f"cursor must be a non-negative int, got {cursor!r}")
    if type(limit) is not int or not 1 <= limit <= MAX_SCAN_ROWS:
        raise ValueError(f"limit must be an int from 1 to {MAX_SCAN_ROWS}, got {limit!r}")


def list_objects_request(cursor: int, limit: int) -> Message:
    _check_scan(cursor, limit)
    return {"op": Op.LIST_OBJECTS, "cursor": cursor, "limit": limit}


def flush_request(cursor: int, limit: int, layout: int | None, fmt: str | None) -> Message:
    _check_scan(cursor, limit)
    if layout is not None and (type(layout) is not int or not 0 <= layout <= _U64):
        raise ValueError(f"layout must be a fingerprint from 0 to 2**64-1, got {layout!r}")
    if fmt is not None and fmt not in OBJECT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(OBJECT_FORMATS)}, got {fmt!r}")
    return {"op": Op.FLUSH, "cursor": cursor, "limit": limit, "layout": layout, "format": fmt}


def _count(op: Op, reply: Message, name: str, value: object = None) -> int:
    value = reply.get(name) if value is None else value
    if type(value) is not int or value < 0:
        raise MalformedReply(f"malformed reply: field {name!r} is {value!r}, expected a count", op, reply)
    return value


def _next_cursor(op: Op, reply: Message, cursor: int) -> int | None:
    value = reply.get("next_cursor")
    if value is not None and (type(value) is not int or value < cursor):
        raise MalformedReply(f"malformed reply: next_cursor {value!r} before the cursor {cursor}", op, reply)
    return value


def parse_objects_page(reply: Message, cursor: int) -> ObjectsPage:
    op = Op.LIST_OBJECTS
    raw = reply.get("groups")
    if type(raw) is not list or not all(type(g) is dict for g in raw):
        raise MalformedReply("malformed reply: 'groups' is not a list of maps", op, reply)
    groups = []
    for group in raw:
        if group.get("format") not in OBJECT_FORMATS:
            raise MalformedReply(f"malformed reply: group format {group.get('format')!r}", op, reply)
        counts = [_count(op, reply, name, group.get(name)) for name in ("layout", "objects", "pages", "bytes",
                                                                        "pinned")]  # fmt: skip
        groups.append(ObjectGroup(counts[0], group["format"], *counts[1:]))
    return ObjectsPage(tuple(groups), _next_cursor(op, reply, cursor))


def parse_flush_page(reply: Message, cursor: int) -> FlushPage:
    op = Op.FLUSH
    evicted, evicted_bytes, pinned, held_back = (
        _count(op, reply, name) for name in ("evicted", "evicted_bytes", "pinned", "held_back"))
    quota, retry = reply.get("quota"), reply.get("retry_after_s")
    if (quota is not None and type(quota) is not str) or not isinstance(retry, (int, float)) or retry < 0:
        raise MalformedReply(f"malformed reply: quota {quota!r}, retry_after_s {retry!r}", op, reply)
    return FlushPage(evicted, evicted_bytes, pinned, held_back, quota, float(retry), _next_cursor(op, reply, cursor))
