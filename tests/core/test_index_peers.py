"""What one peer may cost the index: connections accepted a few per loop
callback, per-peer budgets of new connections and of auth failures
(refused at accept, counted, logged a line at a time), a bounded table of
peers, and a large reserve's records added a slice per step."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maru_core.index.accept import ACCEPT_BATCH, REFUSED_PAUSE_S, Acceptor, bind_tcp
from maru_core.index.launcher import ThreadedIndex
from maru_core.index.limits import ServerLimits
from maru_core.index.peers import Budget, PeerLimiter, peer_of
from maru_core.protocol import PROTOCOL_VERSION, FrameDecoder, SlotList, pack_lengths, parse_url
from test_server import TOKEN, Raw, key
from test_server_limits import _while_the_loop_is_blocked, raw_from, server_of, wait_for


#: A received-bytes budget no test of the other two budgets meets.
ANY_BYTES = Budget(1e12, 2**40)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool(make_pool):
    return make_pool("test-peers", 64 * 1024 * 1024, 4096)


def refused_at_accept(url: str) -> bool:
    """Whether a new connection is closed without an answer to a right hello."""
    try:
        raw = Raw(url)
        raw.send({"op": "hello", "protocol": PROTOCOL_VERSION, "client": "probe", "token": TOKEN})
        return raw.closed_by_peer()  # a reply would be bytes, not the end of the stream
    except ConnectionResetError:
        return True  # reset while connecting or sending


# -- the buckets -------------------------------------------------------------------------------


def test_a_peer_gets_its_burst_then_its_rate_and_others_are_not_affected() -> None:
    clock = Clock()
    peers = PeerLimiter(Budget(2.0, 5), Budget(1.0, 3), ANY_BYTES, clock=clock)
    assert [peers.admit("10.0.0.1") for _ in range(7)] == [None] * 5 + ["connections"] * 2
    assert peers.admit("10.0.0.2") is None  # another address: its own budget
    clock.now += 1.0  # two connections' worth
    assert [peers.admit("10.0.0.1") for _ in range(3)] == [None, None, "connections"]


def test_auth_failures_never_refuse_a_peer_they_hold_back_its_failing_answers() -> None:
    """Within its budget a failure is answered at once; beyond, the failing connection
    waits the time the bucket needs to hold a token again. No connection is refused."""
    clock = Clock()
    peers = PeerLimiter(Budget(100.0, 100), Budget(0.5, 2), ANY_BYTES, clock=clock)
    holds = []
    for _ in range(4):
        assert peers.admit("p") is None
        holds.append(peers.auth_failed("p"))
    assert holds == [0.0, 0.0, 2.0, 4.0]
    clock.now += 6.0  # three failures' worth back
    assert peers.auth_failed("p") == 0.0


def test_the_back_off_of_failures_is_bounded() -> None:
    peers = PeerLimiter(Budget(100.0, 100), Budget(1.0, 3), ANY_BYTES, clock=Clock())
    holds = [peers.auth_failed("p") for _ in range(100)]
    assert max(holds) == 3.0  # as deep as the burst, no deeper


def test_a_connection_closed_before_sending_a_byte_gets_its_token_back() -> None:
    peers = PeerLimiter(Budget(0.001, 2), Budget(1.0, 3), ANY_BYTES, clock=Clock())
    for _ in range(10):  # a connect/close flood
        assert peers.admit("p") is None
        peers.refund("p")
    assert peers.admit("p") is None and peers.admit("p") is None  # its budget is whole
    assert peers.admit("p") == "connections"
    peers.refund("p"), peers.refund("p"), peers.refund("p")
    assert [peers.admit("p") for _ in range(3)] == [None, None, "connections"]  # never above its burst


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(st.tuples(st.integers(0, 9), st.floats(0, 2), st.booleans()), max_size=300),
    rate=st.floats(0.1, 50),
    burst=st.integers(1, 20),
    max_peers=st.integers(1, 6),
)
def test_no_peer_ever_gets_more_than_its_burst_plus_its_rate(events, rate, burst, max_peers) -> None:
    """Over any span, a peer is admitted at most ``burst + rate * span`` times
    (while it stays in the table), and the table never outgrows ``max_peers``."""
    clock = Clock()
    peers = PeerLimiter(Budget(rate, burst), Budget(1.0, 4), ANY_BYTES, max_peers=max_peers, clock=clock)
    admitted: dict[int, list[float]] = {}
    start = clock.now
    for peer, wait, fail in events:
        clock.now += wait
        if peers.admit(str(peer)) is None:
            admitted.setdefault(peer, []).append(clock.now)
        if fail:
            peers.auth_failed(str(peer))
        assert len(peers) <= max_peers
    if max_peers >= 10:  # nobody was forgotten: the bound holds for everyone
        for times in admitted.values():
            assert len(times) <= burst + rate * (clock.now - start) + 1e-9


def test_a_peer_s_bytes_beyond_its_burst_hold_its_reading_for_what_they_cost() -> None:
    clock = Clock()
    peers = PeerLimiter(ANY_BYTES, ANY_BYTES, Budget(1000.0, 4000), clock=clock)
    assert [peers.received("p", 1000) for _ in range(4)] == [0.0] * 4  # its burst
    assert peers.received("p", 500) == 0.5  # 500 bytes beyond: half a second at 1,000 a second
    assert peers.received("q", 4000) == 0.0  # another peer: its own budget
    clock.now += 0.5
    assert peers.received("p", 1000) == 1.0
    clock.now += 10.0  # refilled, to its burst only
    assert peers.received("p", 4000) == 0.0 and peers.received("p", 1) == 0.001


@settings(max_examples=100, deadline=None)
@given(
    reads=st.lists(st.tuples(st.integers(1, 5000), st.floats(0, 0.5)), max_size=200),
    rate=st.floats(100, 10_000),
    burst=st.integers(1, 20_000),
)
def test_a_peer_read_only_when_not_held_gets_at_most_its_burst_plus_its_rate(reads, rate, burst) -> None:
    """A connection honouring every hold has read at most ``burst + rate * span`` bytes
    by the end of its last hold."""
    clock = Clock()
    peers = PeerLimiter(ANY_BYTES, ANY_BYTES, Budget(rate, burst), clock=clock)
    start, total = clock.now, 0
    for nbytes, pause in reads:
        clock.now += pause
        total += nbytes
        clock.now += peers.received("p", nbytes)  # read again only after the hold
        assert total <= (burst + rate * (clock.now - start)) * (1 + 1e-9)


def test_the_table_forgets_the_least_recently_seen_peer() -> None:
    peers = PeerLimiter(Budget(1.0, 1), Budget(1.0, 1), ANY_BYTES, max_peers=2, clock=Clock())
    assert peers.admit("a") is None and peers.admit("b") is None
    assert peers.admit("a") == "connections"  # a is now the most recent
    assert peers.admit("c") is None  # b goes
    assert len(peers) == 2 and peers.admit("a") == "connections" and peers.admit("b") is None


@pytest.mark.parametrize("field, value", [("peer_connection_rate", 0.0), ("peer_auth_failure_rate", float("inf")),
                                          ("peer_connection_burst", 0), ("max_peers", 0),
                                          ("peer_receive_rate", -1.0), ("peer_receive_burst", 0)])  # fmt: skip
def test_bad_peer_limits_are_refused(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: value})


def test_a_unix_socket_peer_is_its_user() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert peer_of(left, "") == f"uid {os.getuid()}"
    finally:
        left.close(), right.close()


# -- accepting ---------------------------------------------------------------------------------


def test_a_connection_storm_is_accepted_a_few_connections_per_loop_pass(pool) -> None:
    with ThreadedIndex(pool, token=TOKEN) as index:
        server = server_of(index)
        passes = {"n": 0}

        def tick() -> None:  # runs once per pass of the loop
            passes["n"] += 1
            index._loop.call_soon(tick)

        index._loop.call_soon_threadsafe(tick)
        admitted_in_pass: list[int] = []
        admit = server.admit
        server.admit = lambda conn: admitted_in_pass.append(passes["n"]) or admit(conn)
        storm: list[socket.socket] = []
        address = parse_url(index.url)
        _while_the_loop_is_blocked(index, lambda: storm.extend(
            socket.create_connection((address.host, address.port), timeout=5) for _ in range(60)))  # fmt: skip
        assert wait_for(lambda: len(admitted_in_pass) == 60)
        busiest = max(admitted_in_pass.count(n) for n in set(admitted_in_pass))
        assert busiest <= ACCEPT_BATCH, busiest
        for sock in storm:
            sock.close()


def test_a_callback_that_refuses_everything_pauses_accepting() -> None:
    """A flood of refused connections is taken a batch per pause, not a socket per loop pass."""
    loop = asyncio.new_event_loop()
    listener = bind_tcp("127.0.0.1", 0)[0]
    refused: list[float] = []

    def refuse(sock, address) -> bool:
        sock.close()
        refused.append(loop.time())
        return False

    acceptor = Acceptor(loop, listener, refuse)
    callbacks: list[float] = []
    accept_some = acceptor._accept_some
    acceptor._accept_some = lambda: (callbacks.append(loop.time()), accept_some())
    clients = []
    try:
        acceptor.start()
        for _ in range(30):
            clients.append(socket.create_connection(listener.getsockname(), timeout=5))
            loop.run_until_complete(asyncio.sleep(0.001))  # one connection at a time, as a flood arrives
        loop.run_until_complete(asyncio.sleep(0.05))
        assert len(refused) == 30
        gaps = [b - a for a, b in zip(callbacks, callbacks[1:])]
        assert min(gaps) >= REFUSED_PAUSE_S * 0.9, gaps  # never two refusing callbacks back to back
        assert len(callbacks) < 30  # so several sockets per callback
    finally:
        acceptor.close()
        for sock in clients:
            sock.close()
        loop.close()


def test_a_refused_flood_that_fills_the_accept_queue_is_drained_and_a_neighbour_gets_in_at_once() -> None:
    """A flood of refused connects fast enough to fill the kernel's accept queue
    during the pause is drained without it: a full queue drops every new SYN, a
    neighbour's too, whose connect would then wait a second for the retransmit."""
    loop = asyncio.new_event_loop()
    listener = bind_tcp("127.0.0.1", 0, backlog=64)[0]
    refused, taken = [0], []

    def on_accepted(sock, address) -> bool:
        if address[0] == "127.0.0.2":
            sock.close()
            refused[0] += 1
            return False
        taken.append(sock)
        return True

    acceptor = Acceptor(loop, listener, on_accepted)
    acceptor.start()
    stop = threading.Event()

    def flood() -> None:  # about 10,000 connects a second from another address: 100 per pause
        held: deque = deque()
        while not stop.is_set():
            for _ in range(50):
                sock = socket.socket()
                sock.setblocking(False)
                sock.bind(("127.0.0.2", 0))
                sock.connect_ex(listener.getsockname())
                held.append(sock)
                if len(held) > 512:
                    held.popleft().close()
            time.sleep(0.005)
        for sock in held:
            sock.close()

    threads = [threading.Thread(target=loop.run_forever, daemon=True), threading.Thread(target=flood, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.3)  # the flood under way
        connects = []
        for _ in range(5):
            started = time.monotonic()
            neighbour = socket.create_connection(listener.getsockname(), timeout=5)
            connects.append(time.monotonic() - started)
            assert wait_for(lambda: neighbour.getsockname() in [s.getpeername() for s in list(taken)], 1)
            neighbour.close()
            time.sleep(0.05)
        assert refused[0] > 200, refused  # the flood was refused at accept all along
        assert max(connects) < 0.5, connects  # no neighbour's SYN was dropped and retransmitted
    finally:
        stop.set()
        threads[1].join(5)
        loop.call_soon_threadsafe(loop.stop)
        threads[0].join(5)
        acceptor.close()
        for sock in taken:
            sock.close()
        loop.close()


# -- budgets at the server ---------------------------------------------------------------------


def test_a_peer_over_its_connection_budget_is_closed_at_accept_and_counted(pool, caplog) -> None:
    limits = ServerLimits(peer_connection_burst=3, peer_connection_rate=0.01)
    with ThreadedIndex(pool, token=TOKEN, limits=limits, with_metrics=True) as index:
        served = [Raw(index.url) for _ in range(3)]
        assert all(raw.hello()["ok"] for raw in served)
        with caplog.at_level(logging.WARNING, logger="maru_core.index.server"):
            for _ in range(20):
                assert refused_at_accept(index.url)
        assert wait_for(lambda: server_of(index).rate_limited["connections"] == 20)
        lines = [r for r in caplog.records if "over its budget" in r.getMessage()]
        assert len(lines) == 1 and "--peer-connection-rate" in lines[0].getMessage()
        metrics = index.service.metrics.registry
        assert metrics.get_sample_value("maru_index_rate_limited_total", {"reason": "connections"}) == 20
        assert metrics.get_sample_value("maru_index_rate_limited_total", {"reason": "auth_failures"}) == 0
        other = raw_from(index.url, "127.0.0.2")  # another peer still gets in
        assert other.hello()["ok"]
        assert all(raw.call(op="heartbeat")["ok"] for raw in served)  # and those served stay served
        for raw in [*served, other]:
            raw.close()


def test_a_guessing_peer_waits_for_its_failures_and_its_neighbours_get_in_at_once(pool) -> None:
    limits = ServerLimits(peer_auth_failure_burst=2, peer_auth_failure_rate=1.0)
    with ThreadedIndex(pool, token=TOKEN, limits=limits, with_metrics=True) as index:
        for _ in range(2):
            guess = Raw(index.url)
            assert guess.hello("wrong-guess")["error"]["type"] == "auth"
            guess.close()
        guess = Raw(index.url)
        started = time.monotonic()
        guess.send({"op": "hello", "protocol": PROTOCOL_VERSION, "client": "raw", "token": "wrong-again"})
        neighbour = Raw(index.url)  # the same address, the right token: answered at once
        assert neighbour.hello()["ok"] and time.monotonic() - started < 0.5
        assert guess.recv()["error"]["type"] == "auth"
        assert time.monotonic() - started >= 0.9  # one failure over the budget: held a second
        assert guess.closed_by_peer()
        server = server_of(index)
        assert server.rate_limited["auth_failures"] == 1 and server.rate_limited["connections"] == 0
        metrics = index.service.metrics.registry
        assert metrics.get_sample_value("maru_index_auth_failures_total") == 3
        assert metrics.get_sample_value("maru_index_rate_limited_total", {"reason": "auth_failures"}) == 1
        assert neighbour.call(op="heartbeat")["ok"]
        guess.close(), neighbour.close()


def test_a_connection_its_peer_closes_unused_costs_no_budget(pool) -> None:
    """A connect/close flood from an address leaves its budget whole for the clients behind it."""
    limits = ServerLimits(peer_connection_burst=3, peer_connection_rate=0.01)
    with ThreadedIndex(pool, token=TOKEN, limits=limits) as index:
        address = parse_url(index.url)
        for _ in range(30):
            socket.create_connection((address.host, address.port), timeout=5).close()
        time.sleep(0.3)  # the index saw them all go
        served = [Raw(index.url) for _ in range(3)]
        assert all(raw.hello()["ok"] for raw in served)
        assert refused_at_accept(index.url)  # the budget of 3 still holds
        for raw in served:
            raw.close()


def test_the_default_budgets_let_a_fleet_reconnect_at_once(pool) -> None:
    """300 clients reconnecting at once from one address (a NAT, or one node's
    pods over a Unix socket) all get in within the default burst and rate."""
    with ThreadedIndex(pool, token=TOKEN) as index:
        clients = []
        deadline = time.monotonic() + 10
        while len(clients) < 300 and time.monotonic() < deadline:
            try:
                raw = Raw(index.url)
                assert raw.hello()["ok"]
                clients.append(raw)
            except OSError:
                time.sleep(0.05)  # refused: a client backs off and retries
        assert len(clients) == 300
        assert server_of(index).rate_limited["connections"] <= 50
        for raw in clients:
            raw.close()


# -- large reserves ----------------------------------------------------------------------------


def test_a_large_reserve_adds_its_records_a_slice_per_step_letting_others_in(pool) -> None:
    with ThreadedIndex(pool, token=TOKEN) as index:
        big, normal = Raw(index.url), Raw(index.url)
        big.hello(), normal.hello()
        records = server_of(index).registry._records
        added: list[int] = []
        add = records.add
        records.add = lambda keys: added.append(len(keys) // 16) or add(keys)
        keys = b"".join(key(i) for i in range(12_000))
        large = {"op": "reserve", "keys": keys, "lengths": pack_lengths([100] * 12_000)}
        _while_the_loop_is_blocked(index, lambda: (big.send(large), normal.send({"op": "heartbeat"})))
        slots = SlotList.from_wire(big.recv()["slots"])
        assert normal.recv()["ok"]
        assert sum(slot is not None for slot in slots) == 12_000
        assert max(added) <= 2048 and sum(added) == 12_000, added
        big.close(), normal.close()
