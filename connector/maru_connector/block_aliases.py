"""What a store registers so that hits reach vLLM's block, not whole chunks.

A chunk key names the prefix up to the end of its chunk. With each chunk it
stores, an engine registers the chunk's block aliases
(``maru_core.keys.block_alias_keys``): alias *j* names the prefix up to the
chunk's *j*-th block and points at the chunk, whose first *j* blocks hold
exactly that KV. Once a request's prompt is computed, the whole blocks of
its last, partial chunk are stored too, as a *prompt tail*: an object of a
whole chunk's size under the key of its longest alias, its first blocks
the prompt's, the rest filled with copies of its last whole block (never
loaded: no alias reaches them); its aliases point at it. So a later prompt
that shares a stored prompt through any block finds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from maru_connector.identity import RequestKeys


def chunk_aliases(keys: RequestKeys, start: int, end: int, blocks_per_chunk: int) -> tuple[tuple[bytes, ...], ...]:
    """Per rank, per chunk ``start`` to ``end``: its block aliases packed end to end."""
    most = blocks_per_chunk - 1
    return tuple(tuple(b"".join(keys.block_aliases(rank, c, most)) for c in range(start, end))
                 for rank in range(len(keys.by_rank)))


@dataclass(frozen=True)
class PromptTail:
    """The store of a prompt's last, partial chunk: one more chunk of a store."""

    keys_by_rank: tuple[bytes, ...]  # each rank's key: its longest alias
    block_ids: tuple[int, ...]  # the whole blocks, then copies of the last one
    aliases_by_rank: tuple[bytes, ...]  # each rank's aliases of it, packed end to end


def prompt_tail(keys: RequestKeys, block_ids: list[int], blocks_per_chunk: int) -> PromptTail | None:
    """The tail of a computed prompt (``None``: no whole block past its last whole chunk)."""
    chunk = keys.num_chunks
    blocks = keys.alias_blocks(chunk)
    first = chunk * blocks_per_chunk
    if not blocks or len(block_ids) < first + blocks:
        return None
    whole = tuple(block_ids[first : first + blocks])
    aliases = [keys.block_aliases(rank, chunk, blocks) for rank in range(len(keys.by_rank))]
    return PromptTail(keys_by_rank=tuple(a[-1] for a in aliases),
                      block_ids=whole + (whole[-1],) * (blocks_per_chunk - blocks),
                      aliases_by_rank=tuple(b"".join(a) for a in aliases))
