"""The index's ``put_aliases`` and ``match_alias`` ops over its ``AliasTable``
(``maru_core.index.aliases``), and what a whole-cache flush does to it.

``put_aliases`` stores a slice of ``PUT_SLICE`` aliases per step;
``match_alias`` checks the candidates' distinct targets in order, the
object keys of a batch of targets looked up at once, with other connections
answered between batches of ``LOOKUP_SLICE_KEYS`` keys. Both run as the
server's sliced jobs. ``match_alias`` is read-only for the pool: it pins and
reserves nothing, and refreshes only the alias it answers.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, TypedDict

from maru_core.index.aliases import AliasTable
from maru_core.keys import KEY_BYTES, packed_layer_keys

if TYPE_CHECKING:
    from maru_core.index.connection import Reply
    from maru_core.index.object_ops import FlushArgs
    from maru_core.index.registry import Registry

#: Aliases stored per step of a ``put_aliases`` (about 0.3 ms; 16,384 in one step took 5 to 20 ms).
PUT_SLICE = 1024
#: Object keys a ``match_alias`` looks up before it lets other connections in.
LOOKUP_SLICE_KEYS = 8192


class PutAliasesArgs(TypedDict):
    """A ``put_aliases`` request's arguments, as ``protocol.messages.SCHEMAS`` checked them."""

    aliases: bytes  # packed, as many as targets
    targets: bytes


class MatchAliasArgs(TypedDict):
    """A ``match_alias`` request's arguments: candidates packed, in order of preference;
    ``layers`` ``None`` for chunkwise targets (the target key is the object's key)."""

    candidates: bytes
    layers: tuple[int, ...] | None


class AliasOps:
    """``put_aliases`` and ``match_alias`` over ``table``, checking targets in ``registry``."""

    def __init__(self, table: AliasTable, registry: "Registry") -> None:
        self.table = table
        self._registry = registry

    def put_aliases(self, lease_id: str, args: PutAliasesArgs) -> Generator[None, None, "Reply"]:
        """Store the aliases a slice per step; answer how many were stored."""
        aliases, targets = args["aliases"], args["targets"]
        step = PUT_SLICE * KEY_BYTES
        stored = 0
        for start in range(0, len(aliases), step):
            if start:
                yield
            self._registry.renew(lease_id)
            stored += self.table.put_packed(aliases[start : start + step], targets[start : start + step])
        return {"stored": min(stored, self.table.capacity)}

    def match_alias(self, lease_id: str, args: MatchAliasArgs) -> Generator[None, None, "Reply"]:
        """The position of the first candidate whose target's objects are all committed,
        and that target; ``None`` for both when none is.

        The distinct targets, in the order of their first candidate, are checked a
        batch per step, each batch's object keys looked up at once (at most
        ``LOOKUP_SLICE_KEYS``, or one target's); the first target found whole is
        the one of the first candidate that has a whole target."""
        self._registry.renew(lease_id)
        candidates, layers = args["candidates"], args["layers"]
        first_of: dict[bytes, int] = {}  # distinct target -> its first candidate's position
        for position, target in enumerate(self.table.targets_of(candidates)):
            if target is not None and target not in first_of:
                first_of[target] = position
        targets = list(first_of)
        per_target = 1 if layers is None else len(layers)
        batch = max(1, LOOKUP_SLICE_KEYS // per_target)
        for start in range(0, len(targets), batch):
            if start:
                yield
            chosen = b"".join(targets[start : start + batch])
            keys = chosen if layers is None else packed_layer_keys(chosen, layers)
            whole = self._registry.committed(keys).reshape(-1, per_target).all(axis=1)
            if whole.any():
                target = targets[start + int(whole.argmax())]
                position = first_of[target]
                self.table.touch(candidates[position * KEY_BYTES : (position + 1) * KEY_BYTES], target)
                return {"position": position, "target": target}
        return {"position": None, "target": None}

    def clearing_after(self, flush: Callable[[str, "FlushArgs"], Generator[None, None, "Reply"]]
                       ) -> Callable[[str, "FlushArgs"], Generator[None, None, "Reply"]]:  # fmt: skip
        """``flush`` that also clears the table when it flushed the whole cache: a request
        with no ``layout`` or ``format`` filter that reached the record table's end (the
        last request of ``marucache flush`` without filters). A flush by layout or
        format, or of rows short of the end, keeps the aliases: those whose targets it
        evicted answer as unknown from then on, and age out."""

        def flush_and_clear(lease_id: str, args: "FlushArgs") -> Generator[None, None, "Reply"]:
            reply = yield from flush(lease_id, args)
            if args["layout"] is None and args["format"] is None and reply["next_cursor"] is None:
                self.table.clear()
            return reply

        return flush_and_clear
