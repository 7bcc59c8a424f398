"""The wire side of ``put_aliases`` and ``match_alias`` for clients: requests
built and checked before they leave, and replies checked
(``maru_core.index.alias_ops`` is the index's side)."""

from __future__ import annotations

from collections.abc import Sequence

from maru_core.index.api import MalformedReply
from maru_core.keys import KEY_BYTES
from maru_core.protocol import Message, Op, pack_keys


def put_aliases_request(items: Sequence[tuple[bytes, bytes]]) -> Message:
    """A ``put_aliases`` request: aliases and targets packed, as two bins of keys end to end.
    ``ValueError`` for a key that is not ``KEY_BYTES`` bytes."""
    items = list(items)
    try:
        aliases = pack_keys([alias for alias, _ in items])
        targets = pack_keys([target for _, target in items])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"put_aliases takes (alias key, target chunk key) pairs of {KEY_BYTES}-byte keys: "
                         f"{exc}") from None  # fmt: skip
    return {"op": Op.PUT_ALIASES, "aliases": aliases, "targets": targets}


def match_alias_request(candidates: bytes | Sequence[bytes], layers: Sequence[int] | None) -> Message:
    """A ``match_alias`` request: candidates packed; ``layers`` as a list (``None``: chunkwise)."""
    return {"op": Op.MATCH_ALIAS, "candidates": pack_keys(candidates),
            "layers": None if layers is None else list(layers)}  # fmt: skip


def parse_match_alias(reply: Message, request: Message) -> tuple[int, bytes] | None:
    """A ``match_alias`` reply: ``(position, target)``, the position one of the candidates
    asked and the target a key; ``None`` when no candidate matched."""
    position, target = reply.get("position"), reply.get("target")
    if position is None and target is None:
        return None
    count = len(request["candidates"]) // KEY_BYTES
    if type(position) is not int or not 0 <= position < count or type(target) is not bytes or len(target) != KEY_BYTES:
        raise MalformedReply(f"malformed reply: position {position!r} of {count} candidates, target "
                             f"{str(target)[:48]}", Op.MATCH_ALIAS, reply)  # fmt: skip
    return position, target


def parse_stored(reply: Message, request: Message) -> int:
    """A ``put_aliases`` reply: how many aliases were stored, at most as many as sent."""
    stored = reply.get("stored")
    count = len(request["aliases"]) // KEY_BYTES
    if type(stored) is not int or not 0 <= stored <= count:
        raise MalformedReply(f"malformed reply: stored {stored!r} of {count} aliases", Op.PUT_ALIASES, reply)
    return stored
