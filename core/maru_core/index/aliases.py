"""Block aliases: keys naming a prefix that ends inside a stored chunk, each
pointing at that chunk's key.

A chunk key names the whole prefix up to the end of its chunk
(``maru_core.keys``), so a request that shares only the first blocks of a
chunk with a stored one cannot find it by chunk keys. When the connector
stores a chunk it also registers, for each block boundary ``j`` inside it, an
alias: the key of the prefix up to block ``j`` -> the chunk's key. A later
request that misses a chunk asks which of its candidate alias keys points at
a chunk whose objects are all committed (``maru_core.index.alias_ops``), and
loads just that chunk's first ``j`` blocks.

The table holds at most ``capacity`` aliases, least recently used first out:
a put and a hit make an alias most recently used. It is a hint, never a
source of KV: an alias whose target was evicted or flushed answers as
unknown (the target's objects are checked on every match), and a load still
retrieves, pins and verifies the target's objects. It lives in the index's
memory only; a restarted index starts with none.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Sequence

import numpy as np

from maru_core.keys import KEY_BYTES, split_keys

#: Aliases the index keeps by default (``--max-aliases``): about 50 MB at
#: most (measured 186 bytes an entry with a target of its own, about 140
#: when the aliases of one chunk share its target, as a put of a chunk's
#: aliases does).
DEFAULT_MAX_ALIASES = 262144


class AliasTable:
    """Alias key -> target chunk key (both ``KEY_BYTES`` bytes), least recently used
    out past ``capacity``. One thread (the index's loop) uses it; ``len`` and
    the counters may be read from another (a metrics scrape)."""

    def __init__(self, capacity: int = DEFAULT_MAX_ALIASES) -> None:
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"the alias table's capacity must be a whole number of at least 1, got {capacity!r}")
        self.capacity = capacity
        self._targets: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # oldest first
        self.evicted = 0  # aliases dropped to stay within capacity, ever
        self.cleared = 0  # aliases dropped by clear(), ever

    def __len__(self) -> int:
        return len(self._targets)

    def put_packed(self, aliases: bytes, targets: bytes) -> int:
        """Store ``aliases[i] -> targets[i]`` (keys end to end, equal counts), each
        made most recently used, a re-put refreshing its alias (the later target
        wins); return how many are stored: all, or the last ``capacity`` when
        there are more (the earlier ones would be pushed out by the later)."""
        if len(aliases) != len(targets) or len(aliases) % KEY_BYTES:
            raise ValueError(f"aliases and targets must be as many {KEY_BYTES}-byte keys end to end, "
                             f"got {len(aliases)} and {len(targets)} bytes")  # fmt: skip
        count = len(aliases) // KEY_BYTES
        skip = max(0, count - self.capacity) * KEY_BYTES
        alias_keys = split_keys(aliases[skip:])
        table = self._targets
        for alias, target in zip(alias_keys, _shared_targets(targets[skip:])):
            table[alias] = target
            table.move_to_end(alias)
        while len(table) > self.capacity:
            table.popitem(last=False)
            self.evicted += 1
        return len(alias_keys)

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """``put_packed`` of ``(alias, target)`` pairs."""
        aliases, targets = b"".join(a for a, _ in items), b"".join(t for _, t in items)
        if len(aliases) != len(targets) or len(aliases) != KEY_BYTES * len(items):
            raise ValueError(f"aliases and targets must be {KEY_BYTES}-byte keys")
        return self.put_packed(aliases, targets)

    def targets_of(self, candidates: bytes) -> list[bytes | None]:
        """The target of each candidate alias key (keys end to end), ``None`` where unknown;
        nothing is refreshed."""
        get = self._targets.get
        return [get(key) for key in split_keys(candidates)]

    def get(self, alias: bytes) -> bytes | None:
        """The target of ``alias``, or ``None``; nothing is refreshed."""
        return self._targets.get(alias)

    def touch(self, alias: bytes, target: bytes) -> None:
        """A hit: ``alias`` becomes most recently used, if it still points at ``target``."""
        if self._targets.get(alias) == target:
            self._targets.move_to_end(alias)

    def clear(self) -> int:
        """Drop every alias; return how many there were."""
        count = len(self._targets)
        self._targets.clear()
        self.cleared += count
        return count


def _shared_targets(targets: bytes) -> list[bytes]:
    """The keys of ``targets`` (end to end), equal keys one ``bytes`` object: the
    aliases of one chunk (a dozen or more) then hold one copy of its key."""
    if not targets:
        return []
    distinct, which = np.unique(np.frombuffer(targets, dtype=f"V{KEY_BYTES}"), return_inverse=True)
    keys = distinct.tolist()
    if len(keys) == 1:
        return keys * (len(targets) // KEY_BYTES)
    return list(operator.itemgetter(*which.reshape(-1).tolist())(keys))
