"""The index's table of block aliases (``maru_core.index.aliases.AliasTable``):
least recently used out at its capacity, a re-put or a hit refreshes, clear."""

from __future__ import annotations

import pytest

from maru_core.index.aliases import AliasTable


def key(tag: int, i: int) -> bytes:
    return bytes([tag]) + i.to_bytes(4, "little") + bytes(11)


def alias(i: int) -> bytes:
    return key(0xA1, i)


def chunk(i: int) -> bytes:
    return key(0xC4, i)


def held(table: AliasTable, count: int = 16) -> dict[int, bytes]:
    return {i: target for i in range(count) if (target := table.get(alias(i))) is not None}


def test_put_and_get_each_alias_of_a_chunk():
    table = AliasTable(8)
    assert table.put([(alias(i), chunk(0)) for i in range(3)]) == 3
    assert len(table) == 3 and held(table) == {0: chunk(0), 1: chunk(0), 2: chunk(0)}
    assert table.targets_of(alias(1) + alias(9) + alias(2)) == [chunk(0), None, chunk(0)]


def test_the_least_recently_used_go_first_at_capacity():
    table = AliasTable(4)
    table.put([(alias(i), chunk(i)) for i in range(4)])
    table.put([(alias(4), chunk(4)), (alias(5), chunk(5))])
    assert len(table) == 4 and table.evicted == 2
    assert set(held(table)) == {2, 3, 4, 5}


def test_a_re_put_refreshes_the_alias_and_its_target_wins():
    table = AliasTable(3)
    table.put([(alias(i), chunk(i)) for i in range(3)])
    assert table.put([(alias(0), chunk(7))]) == 1  # alias 0 now the most recent
    table.put([(alias(3), chunk(3))])
    assert held(table) == {0: chunk(7), 2: chunk(2), 3: chunk(3)}  # alias 1 was the oldest


def test_a_hit_refreshes_only_an_alias_still_pointing_at_its_target():
    table = AliasTable(3)
    table.put([(alias(i), chunk(i)) for i in range(3)])
    table.touch(alias(0), chunk(0))
    table.touch(alias(1), chunk(9))  # re-pointed meanwhile: not refreshed
    table.put([(alias(3), chunk(3))])
    assert set(held(table)) == {0, 2, 3}


def test_a_put_larger_than_the_table_keeps_its_last_items():
    table = AliasTable(3)
    table.put([(alias(9), chunk(9))])
    assert table.put([(alias(i), chunk(i)) for i in range(5)]) == 3
    assert held(table) == {2: chunk(2), 3: chunk(3), 4: chunk(4)}


def test_clear_drops_every_alias():
    table = AliasTable(8)
    table.put([(alias(i), chunk(i // 2)) for i in range(6)])
    assert table.clear() == 6 and len(table) == 0 and held(table) == {}
    assert table.cleared == 6 and table.evicted == 0
    table.put([(alias(1), chunk(1))])
    assert held(table) == {1: chunk(1)}


def test_the_aliases_of_one_chunk_share_its_key_object():
    table = AliasTable(64)
    table.put_packed(b"".join(alias(i) for i in range(30)), chunk(0) * 15 + chunk(1) * 15)
    targets = [table.get(alias(i)) for i in range(30)]
    assert targets == [chunk(0)] * 15 + [chunk(1)] * 15
    assert len({id(t) for t in targets}) == 2


def test_bad_input_is_refused_and_changes_nothing():
    table = AliasTable(8)
    table.put([(alias(0), chunk(0))])
    with pytest.raises(ValueError, match="16-byte keys"):
        table.put([(alias(1), chunk(1)[:15])])
    with pytest.raises(ValueError, match="as many 16-byte keys"):
        table.put_packed(alias(1) + alias(2), chunk(1))
    assert held(table) == {0: chunk(0)}
    for capacity in (0, -1, 1.5):
        with pytest.raises(ValueError, match="at least 1"):
            AliasTable(capacity)  # type: ignore[arg-type]
