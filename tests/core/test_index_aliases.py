"""Block aliases against a real index process over loopback: ``put_aliases``
then ``match_alias`` (chunkwise and layerwise targets), a target not
committed, aborted, evicted or flushed answers ``None``, the first candidate
whose target is committed wins, malformed requests are refused with nothing
changed, the caps, the table's bound (``--max-aliases``) and its metrics."""

from __future__ import annotations

import urllib.request

import pytest
from quota_objects import numbered

from maru_core.index.client import IndexClient, IndexRejected
from maru_core.keys import packed_layer_keys, split_keys
from maru_core.pool import Pool, SlotHeader
from maru_core.pool.slots import SlotFormat
from maru_core.protocol import ErrorType, Op
from maru_core.protocol.messages import MAX_ALIAS_CANDIDATES, MAX_ALIAS_ITEMS, MAX_ALIAS_LAYERS
from maru_tools.index_process import IndexProcess, free_port

LAYERS = (0, 1, 2, 3)
MODEL_A = 0x1A2B3C4D5E6F7081  # layout fingerprints of two models
MODEL_B = 0x0F0E0D0C0B0A0908
CHUNK = 1  # tags of numbered keys
ALIAS = 2
FILLER = 3


def write(client: IndexClient, pool: Pool, keys: list[bytes], layout: int = MODEL_A,
          fmt: SlotFormat = SlotFormat.CHUNKWISE) -> list[bytes]:  # fmt: skip
    """Reserve ``keys`` and write their heads as a connector's worker does; return them (not committed)."""
    slots = list(client.reserve([(k, 64) for k in keys]))
    assert None not in slots
    for k, slot in zip(keys, slots):
        pool.write_slot_header(slot.offset, SlotHeader(k, slot.generation, 64, fmt=fmt, layout=layout))
    return keys


def store(client: IndexClient, pool: Pool, keys: list[bytes], layout: int = MODEL_A,
          fmt: SlotFormat = SlotFormat.CHUNKWISE) -> None:  # fmt: skip
    assert client.commit(write(client, pool, keys, layout, fmt)) == [True] * len(keys)


def aliases(n: int, first: int = 0) -> list[bytes]:
    return numbered(ALIAS, first + n)[first:]


def chunks(n: int, first: int = 0) -> list[bytes]:
    return numbered(CHUNK, first + n)[first:]


def flush_all(client: IndexClient, layout: int | None = None) -> int:
    evicted, cursor = 0, 0
    while cursor is not None:
        page = client.flush(cursor, layout=layout)
        assert page.quota is None
        evicted, cursor = evicted + page.evicted, page.next_cursor
    return evicted


def with_index(*flags: str, size: str = "16Mi") -> pytest.MarkDecorator:
    """The test's index started with these flags, on a pool of ``size``."""
    return pytest.mark.parametrize("index", [(flags, size)], indirect=True, ids=[" ".join(flags) or "defaults"])


@pytest.fixture
def index(request):
    """An index process (its flags and pool size from ``with_index``), its pool, a client."""
    flags, size = getattr(request, "param", ((), "16Mi"))
    with IndexProcess(pool_size=size, extra_args=("--page-size", "4Ki", *flags)) as proc, \
            Pool.attach(proc.pool_path) as pool:  # fmt: skip
        client = proc.client()
        try:
            yield proc, pool, client
        finally:
            client.close()


def test_an_alias_matches_once_its_chunkwise_target_is_committed_and_pins_nothing(index):
    _, pool, client = index
    target = chunks(1)[0]
    assert client.put_aliases([(a, target) for a in aliases(3)]) == 3
    assert client.match_alias(aliases(3)) is None  # nothing stored under the target yet
    write(client, pool, [target])
    assert client.match_alias(aliases(3)) is None  # reserved, not committed: invisible
    assert client.commit([target]) == [True]
    assert client.match_alias(aliases(3)[::-1]) == (0, target)
    assert client.match_alias([chunks(1, 5)[0], *aliases(1, 2)]) == (1, target)  # packed or a list
    assert client.match_alias(b"".join(aliases(3))) == (0, target)
    stats = client.stats()
    assert stats["pinned_keys"] == 0 and stats["reserved_keys"] == 0 and stats["aliases"] == 3


def test_an_aborted_target_answers_none(index):
    _, pool, client = index
    target = chunks(1)[0]
    client.put_aliases([(aliases(1)[0], target)])
    assert client.abort(write(client, pool, [target])) == 1
    assert client.match_alias(aliases(1)) is None


def test_a_layerwise_target_matches_only_when_every_layer_object_is_committed(index):
    _, pool, client = index
    target, partial = chunks(2)
    store(client, pool, split_keys(packed_layer_keys(target, LAYERS)), fmt=SlotFormat.LAYERWISE)
    store(client, pool, split_keys(packed_layer_keys(partial, LAYERS[:3])), fmt=SlotFormat.LAYERWISE)
    first, second = aliases(2)
    client.put_aliases([(first, partial), (second, target)])
    assert client.match_alias([first, second], LAYERS) == (1, target)  # the first one's layer 3 is missing
    assert client.match_alias([first, second], LAYERS[:3]) == (0, partial)
    assert client.match_alias([first, second]) is None  # chunkwise: no object under the chunk key itself
    assert client.match_alias([second], (0, 7)) is None


def test_the_first_candidate_whose_target_is_committed_wins(index):
    _, pool, client = index
    gone, stored_short, stored_long = chunks(3)
    store(client, pool, [stored_short, stored_long])
    unknown, to_gone, short, long_ = aliases(4)
    client.put_aliases([(to_gone, gone), (short, stored_short), (long_, stored_long)])
    # longest prefix first: the connector asks its candidates in order of preference
    assert client.match_alias([unknown, to_gone, long_, short]) == (2, stored_long)
    assert client.match_alias([unknown, to_gone, short, long_]) == (2, stored_short)
    assert client.match_alias([unknown, to_gone]) is None
    assert client.match_alias([]) is None


def test_a_re_put_points_the_alias_at_its_new_target(index):
    _, pool, client = index
    old, new = chunks(2)
    store(client, pool, [old, new])
    client.put_aliases([(aliases(1)[0], old)])
    assert client.put_aliases([(aliases(1)[0], new)]) == 1
    assert client.match_alias(aliases(1)) == (0, new) and client.stats()["aliases"] == 1


@with_index("--max-evict-fraction", "1", "--max-lease-evict-fraction", "1", size="4Mi")
def test_an_evicted_target_answers_none(index):
    _, pool, client = index
    target = chunks(1)[0]
    store(client, pool, [target])
    client.put_aliases([(aliases(1)[0], target)])
    assert client.match_alias(aliases(1)) == (0, target)
    for batch in range(64):  # fill the pool: the target, least recently used, goes first
        store(client, pool, numbered(FILLER, 64 * (batch + 1))[64 * batch :])
        if client.match_prefix([target]) == 0:
            break
    assert client.stats()["evictions"] > 0 and client.match_prefix([target]) == 0
    assert client.match_alias(aliases(1)) is None


def test_a_flush_by_model_drops_its_targets_and_a_whole_flush_clears_the_table(index):
    _, pool, client = index
    of_a, of_b = chunks(2)
    store(client, pool, [of_a], layout=MODEL_A)
    store(client, pool, [of_b], layout=MODEL_B)
    to_a, to_b = aliases(2)
    client.put_aliases([(to_a, of_a), (to_b, of_b)])
    assert flush_all(client, layout=MODEL_A) == 1
    assert client.match_alias([to_a, to_b]) == (1, of_b)  # the flushed target's alias answers as unknown
    assert client.stats()["aliases"] == 2  # kept: they age out
    store(client, pool, [of_a], layout=MODEL_A)  # stored again: its alias works again
    assert client.match_alias([to_a, to_b]) == (0, of_a)
    assert flush_all(client) == 2
    assert client.stats()["aliases"] == 0 and client.match_alias([to_a, to_b]) is None
    store(client, pool, [of_a, of_b])
    assert client.match_alias([to_a, to_b]) is None  # cleared, not merely unmatched


def raw(client: IndexClient, op: Op, **fields: object) -> dict:
    return client._call({"op": op, **fields})


@pytest.mark.parametrize("fields, error", [
    ({"aliases": b"\x01" * 15, "targets": b"\x02" * 15}, "multiple of 16"),
    ({"aliases": [b"\x01" * 16, b"\x01" * 17], "targets": [b"\x02" * 16] * 2}, "16-byte bins only"),
    ({"aliases": b"\x01" * 32, "targets": b"\x02" * 16}, "2 aliases but 1 targets"),
    ({"aliases": b"\x01" * 16}, "needs field 'targets'"),
    ({"aliases": b"\x01" * 16, "targets": b"\x02" * 16, "layers": None}, "takes no field"),
])
def test_a_malformed_put_aliases_is_refused_and_changes_nothing(index, fields, error):
    _, pool, client = index
    target = chunks(1)[0]
    store(client, pool, [target])
    client.put_aliases([(b"\x01" * 16, target)])
    with pytest.raises(IndexRejected, match=error) as refused:
        raw(client, Op.PUT_ALIASES, **fields)
    assert refused.value.error_type is ErrorType.BAD_REQUEST
    assert client.stats()["aliases"] == 1 and client.match_alias([b"\x01" * 16]) == (0, target)


@pytest.mark.parametrize("fields, error", [
    ({"candidates": b"\x01" * 17}, "multiple of 16"),
    ({"candidates": [b"\x01" * 8]}, "16-byte bins only"),
    ({"candidates": b"\x01" * 16, "layers": []}, "1 to 512 distinct layer indices"),
    ({"candidates": b"\x01" * 16, "layers": [0, 1, 1]}, "distinct"),
    ({"candidates": b"\x01" * 16, "layers": [-1]}, "from 0 to 2\\*\\*32-1"),
    ({"candidates": b"\x01" * 16, "layers": [1 << 32]}, "from 0 to 2\\*\\*32-1"),
    ({"candidates": b"\x01" * 16, "layers": [0, True]}, "layer indices"),
    ({"candidates": b"\x01" * 16, "layers": b"\x00\x00\x00\x00"}, "layer indices"),
    ({"candidates": b"\x01" * 16, "layers": list(range(MAX_ALIAS_LAYERS + 1))}, "1 to 512"),
    ({"layers": [0]}, "needs field 'candidates'"),
])
def test_a_malformed_match_alias_is_refused(index, fields, error):
    _, pool, client = index
    target = chunks(1)[0]
    store(client, pool, [target])
    client.put_aliases([(b"\x01" * 16, target)])
    with pytest.raises(IndexRejected, match=error) as refused:
        raw(client, Op.MATCH_ALIAS, **fields)
    assert refused.value.error_type is ErrorType.BAD_REQUEST
    assert client.match_alias([b"\x01" * 16]) == (0, target)


def test_the_client_refuses_keys_of_the_wrong_size_before_sending(index):
    _, _, client = index
    with pytest.raises(ValueError, match="16-byte keys"):
        client.put_aliases([(b"\x01" * 16, b"\x02" * 15)])
    with pytest.raises(ValueError, match="16 bytes"):
        client.match_alias([b"\x01" * 15])
    assert client.stats()["aliases"] == 0


def test_the_caps_per_request_are_named_and_nothing_of_a_refused_put_is_stored(index):
    _, pool, client = index
    target = chunks(1)[0]
    store(client, pool, [target])
    many = numbered(ALIAS, MAX_ALIAS_ITEMS + 1)
    with pytest.raises(IndexRejected, match=f"{MAX_ALIAS_ITEMS + 1} aliases in one request, more than "
                                            f"{MAX_ALIAS_ITEMS}; split the batch") as refused:  # fmt: skip
        client.put_aliases([(a, target) for a in many])
    assert refused.value.error_type is ErrorType.TOO_LARGE and client.stats()["aliases"] == 0
    assert client.put_aliases([(a, target) for a in many[:MAX_ALIAS_ITEMS]]) == MAX_ALIAS_ITEMS  # in steps
    assert client.stats()["aliases"] == MAX_ALIAS_ITEMS
    candidates = [bytes(16)] * MAX_ALIAS_CANDIDATES
    with pytest.raises(IndexRejected, match=f"{MAX_ALIAS_CANDIDATES + 1} candidates in one request, more than "
                                            f"{MAX_ALIAS_CANDIDATES}; send the preferred ones") as refused:  # fmt: skip
        client.match_alias([*candidates, many[0]])
    assert refused.value.error_type is ErrorType.TOO_LARGE
    assert client.match_alias([*candidates[1:], many[-2]]) == (MAX_ALIAS_CANDIDATES - 1, target)


def test_the_most_layers_and_candidates_one_match_may_look_up(index):
    """256 candidates, each its own target, each of 512 layers: 131,072 object keys, looked up
    in steps; the last candidate's target is the only one stored."""
    _, pool, client = index
    layers = tuple(range(MAX_ALIAS_LAYERS))
    targets = chunks(MAX_ALIAS_CANDIDATES)
    store(client, pool, split_keys(packed_layer_keys(targets[-1], layers)), fmt=SlotFormat.LAYERWISE)
    names = aliases(MAX_ALIAS_CANDIDATES)
    client.put_aliases(list(zip(names, targets)))
    assert client.match_alias(names, layers) == (MAX_ALIAS_CANDIDATES - 1, targets[-1])


def test_a_client_without_the_token_cannot_put_aliases(index):
    proc, _, client = index
    with IndexClient(proc.url, token="not-the-token-of-this-index", timeout_s=2.0) as stranger:
        with pytest.raises(IndexRejected) as refused:
            stranger.put_aliases([(aliases(1)[0], chunks(1)[0])])
    assert refused.value.error_type is ErrorType.AUTH
    assert client.stats()["aliases"] == 0


METRICS_PORT = free_port()


@with_index("--max-aliases", "4", "--metrics-port", str(METRICS_PORT), "--metrics-addr", "127.0.0.1")
def test_the_table_keeps_max_aliases_least_recently_used_out_and_exports_its_size(index):
    _, pool, client = index
    targets = chunks(6)
    store(client, pool, targets)
    names = aliases(6)
    assert client.put_aliases(list(zip(names[:4], targets))) == 4
    assert client.match_alias([names[0]]) == (0, targets[0])  # a hit refreshes alias 0
    assert client.put_aliases(list(zip(names[4:], targets[4:]))) == 2  # aliases 1 and 2 go
    assert [client.match_alias([n]) is not None for n in names] == [True, False, False, True, True, True]
    assert client.put_aliases(list(zip(names, targets))) == 4  # more than the table: its last 4
    assert [client.match_alias([n]) is not None for n in names] == [False, False, True, True, True, True]
    assert client.stats()["aliases"] == 4
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
    assert "maru_index_aliases 4.0" in scraped
    assert "maru_index_alias_evictions_total 3.0" in scraped  # aliases 1, 2, then 0
    assert 'maru_index_rpc_duration_seconds_count{op="match_alias"}' in scraped
