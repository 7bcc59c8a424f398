"""How long a turn of the index's loop is, and what it may do in it: a share
of ``turn_s`` while one peer is served alone, ``shared_turn_s`` once another
peer took a turn within ``CONTENDED_WINDOW_S``; a lone
client's large request runs slices back to back for its whole share, and
one that starts while the loop is contended runs in quarter slices; no
job's slice and no accept begins that would likely end past its turn; the
acceptor takes one connection per callback at least, however short its
turn, and turns of a shared share while any peer is served; a lease at
its page quota is refused a large reserve before any of its keys is looked
up.

``maru_core.index.turns`` names are read through the module inside each test
(``turns.CONTENDED_WINDOW_S``): each test stands or falls on its own.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import maru_core.index.accept as accept
import maru_core.index.connection as connection
import maru_core.index.turns as turns
from maru_core.index.accept import ACCEPT_BATCH, Acceptor, bind_tcp
from maru_core.index.connection import Connection
from maru_core.index.launcher import ThreadedIndex
from maru_core.index.limits import ServerLimits
from maru_core.index.records import KEY_BYTES
from maru_core.index.registry import Registry
from maru_core.index.registry_types import NoSpace, QuotaExceeded, run_to_end
from maru_core.index.turns import PeerTurns
from maru_core.protocol import encode_frame
from test_registry import PAGE, Clock, accounting_adds_up, geometry
from test_registry import key as registry_key
from test_server import TOKEN, Raw, key
from test_server_limits import raw_from, server_of, wait_for

TURN_S, SHARED_TURN_S = 0.001, 0.0002


# -- PeerTurns ---------------------------------------------------------------------------------


class FakeClock:
    """``time.perf_counter`` as the turns module reads it, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)  # hashed by identity, as connections are
class Taker:
    peer_key: str


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(turns, "time", SimpleNamespace(perf_counter=clock))
    return clock


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def take_turn(peer_turns: PeerTurns, taker: Taker, clock: FakeClock, cost_s: float = 0.0) -> str:
    """Offer ``taker`` fresh work costing ``cost_s`` of loop time: ``"ran"`` or ``"waited"``.
    The loop never runs here, so a round's use adds up until the test says otherwise."""
    outcome: list[str] = []

    def turn() -> None:
        clock.now += cost_s
        outcome.append("ran")

    peer_turns.run_or_wait(taker, turn, lambda: outcome.append("waited"))
    return outcome[0]


def test_a_peer_served_alone_gets_shares_of_turn_s(loop, clock) -> None:
    peer_turns = PeerTurns(loop, TURN_S, SHARED_TURN_S)
    first, second = Taker("10.0.0.1"), Taker("10.0.0.1")  # two connections of one peer
    for taker in (first, second, first, second):
        assert take_turn(peer_turns, taker, clock) == "ran"
        clock.now += 0.01
    assert not peer_turns.contended
    assert peer_turns.share_s == TURN_S


def test_another_peer_s_turn_shortens_the_shares_until_the_window_has_passed(loop, clock) -> None:
    peer_turns = PeerTurns(loop, TURN_S, SHARED_TURN_S)
    assert take_turn(peer_turns, Taker("10.0.0.1"), clock) == "ran"
    other = Taker("10.0.0.2")
    assert take_turn(peer_turns, other, clock) == "ran"
    assert peer_turns.contended and peer_turns.share_s == SHARED_TURN_S
    clock.now += turns.CONTENDED_WINDOW_S - 0.001
    assert take_turn(peer_turns, other, clock) == "ran"  # the same peer again: no new contention
    assert peer_turns.share_s == SHARED_TURN_S  # still within the window of the switch
    clock.now += 0.002
    assert not peer_turns.contended and peer_turns.share_s == TURN_S


def test_a_peer_that_used_more_than_a_shared_share_waits_once_another_peer_ran(loop, clock) -> None:
    peer_turns = PeerTurns(loop, TURN_S, SHARED_TURN_S)
    busy = Taker("10.0.0.1")
    assert take_turn(peer_turns, busy, clock, cost_s=0.0005) == "ran"
    assert take_turn(peer_turns, busy, clock, cost_s=0.0001) == "ran"  # alone: 0.5 ms of its 1 ms used
    assert take_turn(peer_turns, Taker("10.0.0.2"), clock) == "ran"
    assert take_turn(peer_turns, busy, clock) == "waited"  # contended: 0.6 ms is past a 0.2 ms share


def test_a_new_connection_alone_does_not_make_the_loop_contended(loop, clock) -> None:
    """Accepting is no turn of a peer: a lone client that reconnects keeps its long shares."""
    peer_turns = PeerTurns(loop, TURN_S, SHARED_TURN_S)
    assert take_turn(peer_turns, Taker("10.0.0.1"), clock) == "ran"
    assert peer_turns.share_s == TURN_S and not peer_turns.contended
    assert take_turn(peer_turns, Taker("10.0.0.1"), clock) == "ran"  # the same peer, a new connection
    assert not peer_turns.contended


@pytest.mark.parametrize("shared_turn_s", [0.005, None])
def test_a_shared_share_is_never_longer_than_turn_s(loop, clock, shared_turn_s) -> None:
    peer_turns = PeerTurns(loop, TURN_S, shared_turn_s)
    assert take_turn(peer_turns, Taker("10.0.0.1"), clock) == "ran"
    assert take_turn(peer_turns, Taker("10.0.0.2"), clock) == "ran"
    assert peer_turns.contended and peer_turns.share_s == TURN_S


def test_the_acceptor_s_turn_is_a_shared_share_while_any_peer_is_served(loop, clock) -> None:
    """An idle flood runs no peer's turn, so a lone client's loop was never contended and each
    accept callback took 1 ms: a fifth of that client's requests waited for one."""
    peer_turns = PeerTurns(loop, TURN_S, SHARED_TURN_S)
    assert peer_turns.accept_share_s == TURN_S  # nobody served: accept in whole turns
    assert take_turn(peer_turns, Taker("10.0.0.1"), clock) == "ran"
    assert not peer_turns.contended and peer_turns.share_s == TURN_S  # the peer's own shares stay long
    assert peer_turns.accept_share_s == SHARED_TURN_S
    clock.now += turns.CONTENDED_WINDOW_S + 0.001
    assert peer_turns.accept_share_s == TURN_S


# -- sliced jobs on a real index ---------------------------------------------------------------


@pytest.fixture
def pool(make_pool):
    return make_pool("test-turn-shares", 64 * 1024 * 1024, 4096)


def set_slice_keys(index: ThreadedIndex, slice_keys: int) -> None:
    """Make requests of more than ``slice_keys`` keys run as jobs of such slices (on the loop)."""
    server = server_of(index)

    def set_them() -> None:
        server._slice_keys = slice_keys
        server._slice_bytes = slice_keys * KEY_BYTES

    index.on_loop(set_them)


def record_commit_slices(index: ThreadedIndex) -> list[int]:
    """The number of keys of each ``Registry.commit`` call the server makes from now on."""
    registry = server_of(index).registry
    commit = registry.commit
    sizes: list[int] = []

    def recording(lease_id, keys, **kwargs):
        sizes.append(len(keys) // KEY_BYTES)
        return commit(lease_id, keys, **kwargs)

    registry.commit = recording
    return sizes


def contended(index: ThreadedIndex) -> bool:
    return index.on_loop(lambda: server_of(index).turns.contended)


def test_a_lone_client_s_large_commit_runs_many_slices_a_turn(pool, monkeypatch) -> None:
    """One slice per turn made a lone engine's large request wait a loop pass per
    slice for nobody: now a job runs slices until its share is used."""
    monkeypatch.setattr(turns, "CONTENDED_WINDOW_S", 0.05, raising=False)  # the accept's contention passes soon
    steps: list[int] = []
    step_job = Connection._step_job

    def counting(self) -> None:
        steps.append(1)
        step_job(self)

    monkeypatch.setattr(Connection, "_step_job", counting)
    # a share of half a second alone: the whole job fits one share, however loaded the machine
    with ThreadedIndex(pool, token=TOKEN, limits=ServerLimits(turn_s=0.5)) as index:
        set_slice_keys(index, 4)
        raw = Raw(index.url)
        raw.hello()
        assert wait_for(lambda: not contended(index))
        assert index.on_loop(server_of(index)._slice_keys_now) == 4
        sizes = record_commit_slices(index)
        keys = b"".join(key(i) for i in range(2000))
        reply = raw.call(op="commit", keys=keys)  # nothing reserved: every key answered False
        assert reply["ok"] and reply["committed"] == [False] * 2000
        assert sizes == [4] * 500  # full slices: nobody else was served
        # one step per slice would be 499 steps after the first slice
        assert len(steps) <= 5, len(steps)
        raw.close()


def test_a_large_request_that_starts_right_after_another_peer_s_runs_in_quarter_slices(pool, monkeypatch) -> None:
    monkeypatch.setattr(turns, "CONTENDED_WINDOW_S", 0.05, raising=False)
    with ThreadedIndex(pool, token=TOKEN) as index:
        server = server_of(index)
        set_slice_keys(index, 8)
        mine, other = Raw(index.url), raw_from(index.url, "127.0.0.2")
        mine.hello(), other.hello()
        assert mine.call(op="heartbeat")["ok"]
        assert wait_for(lambda: not contended(index))  # the switches of the hellos are past
        sizes = record_commit_slices(index)
        keys = b"".join(key(i) for i in range(64))
        assert mine.call(op="commit", keys=keys)["ok"]
        assert sizes == [8] * 8  # served alone: whole slices
        monkeypatch.setattr(turns, "CONTENDED_WINDOW_S", 5.0)  # long enough for the checks below
        assert other.call(op="heartbeat")["ok"]
        sizes.clear()
        assert mine.call(op="commit", keys=keys)["ok"]
        assert sizes == [2] * 32  # started right after the other peer's request: quarter slices
        assert contended(index)
        assert index.on_loop(server._slice_keys_now) == 2
        assert index.on_loop(server._lookup_slice_keys) == 8
        mine.close(), other.close()


def _connection_on_a_test_clock(monkeypatch) -> tuple[Connection, SimpleNamespace, list]:
    """A connection with a 0.4 ms share, its clock ``clock.now`` (the test moves it), and the
    callbacks it left for its next turn (``waits``)."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(connection, "time", SimpleNamespace(perf_counter=lambda: clock.now, monotonic=time.monotonic))
    waits: list = []
    host = SimpleNamespace(limits=ServerLimits(), check_receive_growth=lambda current, wanted: None,
                           turns=SimpleNamespace(share_s=0.0004, wait_turn=lambda conn, turn: waits.append(turn)))
    return Connection(host, "10.0.0.1"), clock, waits


def test_a_job_begins_no_slice_that_would_end_past_its_share(monkeypatch) -> None:
    """A slice begun with any time left ran up to a whole slice past the share (a 0.15 ms slice
    in a 0.2 ms share: 0.3 ms), and another peer's request that arrived meanwhile waited for it."""
    conn, clock, waits = _connection_on_a_test_clock(monkeypatch)
    steps: list[float] = []

    def job():
        for _ in range(10):
            clock.now += 0.00015  # a slice of 0.15 ms
            steps.append(clock.now)
            yield
        return None

    conn._job = job()
    next(conn._job)  # the first slice, as ``handle`` runs it
    started = clock.now
    conn._step_job()
    assert len(steps) == 3 and clock.now - started <= 0.0004, [round(t - started, 6) for t in steps]
    assert waits == [conn._step_job]  # the rest at its next turn
    conn._step_job()
    assert len(steps) == 5


@pytest.mark.parametrize("payload_bytes, deferred", [(1024, False), (connection.WRITE_PIECE_BYTES + 1, True)])
def test_a_job_that_ends_past_its_share_sends_a_large_reply_at_its_next_turn(
        monkeypatch, payload_bytes, deferred) -> None:
    """Encoding a large reply and writing its first piece came on top of the job's last step,
    which often used the share already (a 20,000-key retrieve's pin, then 320 KiB of locations)."""
    conn, clock, waits = _connection_on_a_test_clock(monkeypatch)
    sent: list = []
    monkeypatch.setattr(conn, "_send", lambda reply, whole=False: sent.append(reply))
    monkeypatch.setattr(conn, "_answer_buffered", lambda: None)
    reply = {"id": 7, "ok": True, "locations": bytes(payload_bytes)}

    def job():
        yield
        clock.now += 0.0005  # the last step: past the share
        return reply

    conn._job = job()
    next(conn._job)  # the first slice, as ``handle`` runs it
    conn._step_job()
    if deferred:
        assert sent == [] and waits == [conn._step_job] and conn._job is not None
        conn._step_job()  # its next turn
    assert sent == [reply] and conn._job is None


# -- the early quota refusal -------------------------------------------------------------------


def record_lookups(reg: Registry, monkeypatch) -> list[int]:
    """The number of keys of each ``absent_keys`` call of ``reg`` from now on."""
    absent_keys = reg.absent_keys
    looked_up: list[int] = []

    def recording(keys):
        looked_up.append(len(keys) // KEY_BYTES)
        return absent_keys(keys)

    monkeypatch.setattr(reg, "absent_keys", recording)
    return looked_up


@pytest.mark.parametrize("quota", ["reservations", "peer_reservations"])
def test_a_lease_at_its_page_quota_is_refused_before_its_keys_are_looked_up(monkeypatch, quota) -> None:
    fraction = {"max_lease_pages_fraction" if quota == "reservations" else "max_peer_pages_fraction": 0.25}
    reg = Registry(geometry(100), clock=Clock(), **fraction)
    holder = reg.open_lease("holder", peer="10.0.0.1")
    asker = holder if quota == "reservations" else reg.open_lease("asker", peer="10.0.0.1")
    assert None not in reg.reserve(holder, [(registry_key(i), PAGE) for i in range(25)])  # the whole quota
    looked_up = record_lookups(reg, monkeypatch)
    keys = b"".join(registry_key(100 + i) for i in range(50))
    steps = reg.reserve_sliced(asker, keys, [PAGE] * 50, slice_keys=8)
    with pytest.raises(QuotaExceeded) as refused:
        next(steps)  # the first step
    assert refused.value.quota == quota
    flag = "--max-lease-pool-fraction" if quota == "reservations" else "--max-peer-pool-fraction"
    assert flag in str(refused.value) and "asks for at least 50 more" in str(refused.value)
    assert looked_up == []
    assert reg.stats().reserved_keys == 25
    accounting_adds_up(reg)


def test_a_lease_with_room_left_under_its_quota_is_not_refused_up_front(monkeypatch) -> None:
    reg = Registry(geometry(100), clock=Clock(), max_lease_pages_fraction=0.25)
    lease = reg.open_lease("a")
    assert None not in reg.reserve(lease, [(registry_key(i), PAGE) for i in range(20)])
    looked_up = record_lookups(reg, monkeypatch)
    keys = b"".join(registry_key(100 + i) for i in range(5))  # exactly the room left
    slots = run_to_end(reg.reserve_sliced(lease, keys, [PAGE] * 5, slice_keys=2))
    assert None not in slots and len(slots) == 5
    assert sum(looked_up) >= 5  # looked up as ever
    assert reg.stats().reserved_keys == 25
    accounting_adds_up(reg)


def test_a_large_batch_into_a_full_pool_with_nothing_to_evict_is_refused_before_its_keys_are_looked_up(
        monkeypatch) -> None:
    reg = Registry(geometry(100), clock=Clock())
    holder, asker = reg.open_lease("holder", peer="10.0.0.1"), reg.open_lease("asker", peer="10.0.0.2")
    assert None not in reg.reserve(holder, [(registry_key(i), PAGE) for i in range(100)])  # every page, reserved
    looked_up = record_lookups(reg, monkeypatch)
    keys = b"".join(registry_key(100 + i) for i in range(50))
    with pytest.raises(NoSpace) as refused:
        next(reg.reserve_sliced(asker, keys, [PAGE] * 50, slice_keys=8))  # the first step
    assert "no room for any of 50 objects" in str(refused.value)
    assert looked_up == []
    assert reg.stats().reserved_keys == 100
    accounting_adds_up(reg)


def test_a_large_batch_into_a_full_pool_whose_objects_are_kept_for_another_peer_is_refused_up_front(
        monkeypatch) -> None:
    """The other peer's committed objects lie within its fair share: nothing may be evicted for
    the asker, which holds the rest of the pool reserved."""
    reg = Registry(geometry(100), clock=Clock())
    other, asker = reg.open_lease("other", peer="10.0.0.1"), reg.open_lease("asker", peer="10.0.0.2")
    kept = [registry_key(i) for i in range(40)]
    assert None not in reg.reserve(other, [(k, PAGE) for k in kept])
    reg.commit(other, kept)
    assert None not in reg.reserve(asker, [(registry_key(100 + i), PAGE) for i in range(60)])
    looked_up = record_lookups(reg, monkeypatch)
    keys = b"".join(registry_key(200 + i) for i in range(50))
    with pytest.raises(NoSpace) as refused:
        next(reg.reserve_sliced(asker, keys, [PAGE] * 50, slice_keys=8))
    assert "kept for other peers" in str(refused.value)
    assert looked_up == []
    assert all(reg.describe(k) is not None for k in kept)  # nothing of the other peer's was evicted
    accounting_adds_up(reg)


def test_a_full_pool_with_something_to_evict_looks_the_batch_up_as_ever(monkeypatch) -> None:
    reg = Registry(geometry(100), clock=Clock())
    holder, asker = reg.open_lease("holder", peer="10.0.0.1"), reg.open_lease("asker", peer="10.0.0.2")
    stored = [registry_key(i) for i in range(100)]
    assert None not in reg.reserve(holder, [(k, PAGE) for k in stored])
    reg.commit(holder, stored[:10])  # ten pages evictable
    looked_up = record_lookups(reg, monkeypatch)
    keys = b"".join(registry_key(100 + i) for i in range(5))
    slots = run_to_end(reg.reserve_sliced(asker, keys, [PAGE] * 5, slice_keys=2))
    assert None not in slots and len(slots) == 5  # placed by evicting
    assert sum(looked_up) >= 5
    accounting_adds_up(reg)


# -- the acceptor's turn -----------------------------------------------------------------------


def accept_all(count: int, **acceptor_kwargs) -> tuple[list[int], int]:
    """Connect ``count`` clients to a fresh listener, then run an ``Acceptor`` until it took
    them all (or 5 s passed): the connections each callback took, and how many were taken."""
    loop = asyncio.new_event_loop()
    listener = bind_tcp("127.0.0.1", 0)[0]
    taken: list[socket.socket] = []

    def take(sock: socket.socket, address: object) -> bool:
        taken.append(sock)
        return True

    acceptor = Acceptor(loop, listener, take, **acceptor_kwargs)
    per_callback: list[int] = []
    accept_some = acceptor._accept_some

    def counting() -> None:
        before = len(taken)
        accept_some()
        per_callback.append(len(taken) - before)

    acceptor._accept_some = counting
    clients = [socket.create_connection(listener.getsockname(), timeout=5) for _ in range(count)]
    try:
        acceptor.start()  # every connection is in the backlog before the first callback
        deadline = time.monotonic() + 5
        while len(taken) < count and time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.001))
        return per_callback, len(taken)
    finally:
        acceptor.close()
        for sock in [*clients, *taken]:
            sock.close()
        loop.close()


def test_an_accept_callback_with_no_time_left_still_takes_one_connection() -> None:
    """A turn of zero seconds (a contended loop's share all used) once made every
    callback take nothing: the backlog stayed readable and the loop spun."""
    turns_asked: list[int] = []
    per_callback, taken = accept_all(6, turn=lambda: turns_asked.append(1) or 0.0)
    assert taken == 6
    assert max(per_callback) == 1 and per_callback.count(0) <= 1, per_callback  # one each, no spinning
    assert len(turns_asked) == len(per_callback)  # asked once per callback


def test_an_accept_callback_with_no_turn_given_takes_several_connections() -> None:
    per_callback, taken = accept_all(6)
    assert taken == 6
    assert max(per_callback) > 1 and max(per_callback) <= ACCEPT_BATCH, per_callback


def refusing_acceptor_run(monkeypatch, turn_s: float, cost_s: float, queue_fill: float = 0.0):
    """One accept callback over a backlog of 10 connections, each refused at ``cost_s`` of a
    fake clock, with a turn of ``turn_s``: (refused, seconds the callback took, its pauses)."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(accept, "time", SimpleNamespace(perf_counter=lambda: clock.now, monotonic=time.monotonic))
    monkeypatch.setattr(accept, "queue_fill", lambda sock: queue_fill)
    loop = asyncio.new_event_loop()
    listener = bind_tcp("127.0.0.1", 0)[0]
    refused: list[socket.socket] = []

    def refuse(sock: socket.socket, address: object) -> bool:
        clock.now += cost_s
        sock.close()
        refused.append(sock)
        return False

    acceptor = Acceptor(loop, listener, refuse, turn=lambda: turn_s)
    pauses: list[float] = []
    acceptor._pause = pauses.append
    clients = [socket.create_connection(listener.getsockname(), timeout=5) for _ in range(10)]
    try:
        assert wait_for(lambda: select.select([listener], [], [], 0)[0], 5)
        time.sleep(0.05)  # the whole backlog queued
        acceptor._accept_some()
        return len(refused), clock.now - 100.0, pauses
    finally:
        acceptor.close()
        for sock in clients:
            sock.close()
        loop.close()


def test_an_accept_callback_begins_no_accept_that_would_end_past_its_turn(monkeypatch) -> None:
    """Accepting and resetting a connection costs about 0.1 ms: a callback that began one
    with any time left ran up to that much past its turn, and a served client's request waited."""
    refused, took_s, pauses = refusing_acceptor_run(monkeypatch, turn_s=0.0004, cost_s=0.00015)
    assert refused == 2 and took_s <= 0.0004, (refused, took_s)  # a third would have ended at 0.45 ms
    assert pauses == [accept.REFUSED_PAUSE_S]
    refused, took_s, _ = refusing_acceptor_run(monkeypatch, turn_s=0.0, cost_s=0.00015)
    assert refused == 1  # one at least, however short the turn


def test_a_drained_flood_pauses_as_long_again_as_a_short_turn(monkeypatch) -> None:
    """Shorter accept turns while peers are served must not drain a flood that fills the accept
    queue any slower: the pause after one is as much shorter (the same share of the loop)."""
    _, took_s, pauses = refusing_acceptor_run(monkeypatch, turn_s=0.0004, cost_s=0.00015, queue_fill=0.9)
    assert len(pauses) == 1 and pauses[0] == pytest.approx(accept.DRAIN_PAUSE_S * took_s / accept.ACCEPT_TURN_S)
    _, took_s, pauses = refusing_acceptor_run(monkeypatch, turn_s=0.01, cost_s=0.002, queue_fill=0.9)
    assert took_s > accept.ACCEPT_TURN_S and pauses == [accept.DRAIN_PAUSE_S]  # a whole turn: the whole pause


def test_an_index_s_accept_turns_are_shared_while_a_client_is_served(pool) -> None:
    with ThreadedIndex(pool, token=TOKEN) as index:
        server = server_of(index)
        raw = Raw(index.url)
        raw.hello()
        assert raw.call(op="heartbeat")["ok"]
        assert not contended(index)  # one peer: its own shares stay whole
        assert index.on_loop(lambda: server._acceptors[0]._turn()) == server.limits.shared_turn_s
        raw.close()


# -- large replies -----------------------------------------------------------------------------


def test_a_large_reply_goes_out_a_piece_per_turn_while_contended_and_arrives_whole(pool, monkeypatch) -> None:
    """Over loopback one ``send`` of a large reply held the loop for milliseconds: while
    the loop is contended it is written a piece per turn, and reads the same."""
    from maru_core.index import connection

    pieces: list[int] = []
    write_pieces = Connection._write_pieces

    def counting(self, parts):
        pieces.append(sum(map(len, parts)))
        return (yield from write_pieces(self, parts))

    monkeypatch.setattr(Connection, "_write_pieces", counting)
    keys = b"".join(key(i) for i in range(8000))  # a retrieve's locations: 16 bytes a key
    with ThreadedIndex(pool, token=TOKEN) as index:
        raw = Raw(index.url)
        raw.hello()
        monkeypatch.setattr(PeerTurns, "contended", property(lambda self: False))
        alone = raw.call(op="retrieve", keys=keys)
        assert alone["ok"] and not pieces
        monkeypatch.setattr(PeerTurns, "contended", property(lambda self: True))
        shared = raw.call(op="retrieve", keys=keys)
        assert shared == {**alone, "id": shared["id"]}
        assert len(pieces) == 1 and pieces[0] > 2 * connection.WRITE_PIECE_BYTES
        assert raw.call(op="heartbeat")["ok"]  # the connection reads again after the last piece
        raw.close()


def test_a_pipelining_connection_s_turns_leave_its_reading_paused(pool, monkeypatch) -> None:
    """A connection with frames still buffered answers one a turn (here) and waits for the next:
    its reading stays paused until they are all answered. Resumed before each turn and paused
    after it, it cost two epoll calls a turn, about a fifth of such a turn's time."""
    resumes: list[int] = []
    made = Connection.connection_made

    def counting_resumes(self, transport) -> None:
        made(self, transport)
        resume = transport.resume_reading  # counted on this transport only
        transport.resume_reading = lambda: (resumes.append(1), resume())[1]

    monkeypatch.setattr(Connection, "connection_made", counting_resumes)
    monkeypatch.setattr(PeerTurns, "share_s", property(lambda self: 1e-9))  # a frame per turn
    with ThreadedIndex(pool, token=TOKEN) as index:
        raw = Raw(index.url)
        raw.hello()
        resumes.clear()
        rids = list(range(100, 300))
        raw.sock.sendall(b"".join(encode_frame({"id": rid, "op": "stats"}) for rid in rids))
        assert [raw.recv()["id"] for _ in rids] == rids
        assert raw.call(op="heartbeat")["ok"]  # reading again
        raw.close()
    assert 1 <= len(resumes) <= 5, len(resumes)  # once per read of the batch, not once per frame


@pytest.mark.parametrize("count, first_turn_looks_up", [(2049, True), (16_384, False)])
def test_a_retrieve_of_256_kib_of_keys_looks_up_none_in_the_turn_that_decoded_it(pool, monkeypatch, count,
                                                                                  first_turn_looks_up) -> None:
    """Decoding a large request is its first turn's work: a retrieve of 256 KiB of keys or more
    starts its lookups in the next turn; a smaller one in the first."""
    from maru_core.index import server as server_module

    assert count * KEY_BYTES >= server_module.LOOKUP_NEXT_TURN_FROM or first_turn_looks_up
    keys = memoryview(b"".join(key(i) for i in range(count)))  # as decoded: a view of the receive buffer
    with ThreadedIndex(pool, token=TOKEN) as index:
        registry = server_of(index).registry
        looked_up: list[int] = []
        lookup = registry._lookup_in_state
        monkeypatch.setattr(registry, "_lookup_in_state", lambda keys, state: (looked_up.append(len(keys)),
                                                                                lookup(keys, state))[1])

        def first_turn() -> None:
            conn = SimpleNamespace(lease_id=registry.open_lease("reader"))
            next(server_of(index)._retrieve_sliced(conn, {"keys": keys}), None)

        index.on_loop(first_turn)
    assert bool(looked_up) == first_turn_looks_up


# -- the deadline sweep ------------------------------------------------------------------------


class IdleConnection:
    """A connection the sweep looks at and leaves open."""

    authenticated = True
    connected_at = last_active = 0.0

    def stalled(self) -> bool:
        return False

    def release_idle_buffer(self, now: float) -> bool:
        return False


def test_the_deadline_sweep_yields_between_hundreds_of_connections_it_leaves_open(pool) -> None:
    """Thousands of idle connections held the loop for milliseconds a sweep: it yielded
    only every 64 closes, and closed none of them."""
    with ThreadedIndex(pool, token=TOKEN) as index:
        server = server_of(index)

        def sweep_steps() -> int:
            saved = dict(server._connections)
            server._connections.clear()
            server._connections.update({IdleConnection(): None for _ in range(1000)})
            try:
                return sum(1 for _ in server._sweep(1.0))
            finally:
                server._connections.clear()
                server._connections.update(saved)

        assert index.on_loop(sweep_steps) >= 3  # 1,000 connections looked at, none closed
