"""What a peer may take from the others, against a real index process:
one peer with many busy connections gets one peer's share of the event
loop, and clients behind one address get in whatever a neighbour without
the token does there (wrong tokens, a connect/close flood).

The attackers run in their own processes; on loopback, 127.0.0.2 is
another peer than the honest clients' 127.0.0.1."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from maru_core.index.client import IndexClient
from maru_core.index.launcher import IndexProcess
from maru_core.index.limits import ServerLimits
from maru_core.protocol import PROTOCOL_VERSION, FrameDecoder, encode_frame, parse_url

TOKEN = "fairness-token-0123456789abcdef"

#: Shared by the attacker scripts: a raw connection from a given source address, and a hello.
_ATTACKER_PRELUDE = """
import socket, sys, threading, time
from maru_core.protocol import PROTOCOL_VERSION, encode_frame, parse_url
address = parse_url(sys.argv[1])
source = sys.argv[2]

def connect():
    sock = socket.create_connection((address.host, address.port), timeout=10, source_address=(source, 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock

def hello(token, rid=0):
    return encode_frame({"id": rid, "op": "hello", "protocol": PROTOCOL_VERSION, "client": "attacker",
                         "token": token})

def read_all(sock):
    try:
        while sock.recv(1 << 20):
            pass
    except OSError:
        pass

def forever(target, *args):
    threading.Thread(target=target, args=args, daemon=True).start()
"""

#: 20 connections with the token, each pipelining ``stats`` as fast as the index takes them, a
#: thread reading the replies all along (one that read only between its batches let them pile
#: up until the index stopped reading from it, and then stalled in ``sendall``).
_PIPELINING = """
def pipeline():
    sock = connect()
    forever(read_all, sock)
    sock.sendall(hello(sys.argv[3]))
    batch = b"".join(encode_frame({"id": i, "op": "stats"}) for i in range(1, 501))
    while True:
        sock.sendall(batch)

for _ in range(20):
    forever(pipeline)
print("attacking", flush=True)
time.sleep(3600)
"""

#: Without the token: wrong-token hellos (two connections at a time, each waiting for its answer)
#: and connections opened and closed as fast as the index takes them.
_WRONG_TOKENS_AND_CONNECT_CLOSE = """
def guess():
    i = 0
    while True:
        try:
            sock = connect()
            sock.sendall(hello(f"guess-{i}"))
            sock.recv(1 << 16)
            sock.close()
        except OSError:
            time.sleep(0.01)
        i += 1

def connect_close():
    while True:
        try:
            connect().close()
        except OSError:
            pass

forever(guess), forever(guess), forever(connect_close)
print("attacking", flush=True)
time.sleep(3600)
"""


@pytest.fixture
def index(pool_path, token_file):
    proc = IndexProcess(pool_path, pool_size="32Mi", token_file=token_file, extra_args=["--log-level", "ERROR"])
    with proc.start():
        yield proc


def start_attacker(script: str, url: str, source: str) -> subprocess.Popen:
    code = textwrap.dedent(_ATTACKER_PRELUDE) + textwrap.dedent(script)
    attacker = subprocess.Popen([sys.executable, "-c", code, url, source, TOKEN], stdout=subprocess.PIPE, text=True)
    assert attacker.stdout is not None and attacker.stdout.readline().strip() == "attacking"
    return attacker


def stop(attacker: subprocess.Popen) -> None:
    attacker.kill()
    attacker.wait(10)


def heartbeat_round_trips(client: IndexClient, count: int) -> np.ndarray:
    """``count`` heartbeats, 5 ms apart: their round trips in milliseconds."""
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        client.heartbeat()
        samples.append(1000 * (time.perf_counter() - started))
        time.sleep(0.005)
    return np.array(samples)


def test_a_peer_with_twenty_pipelining_connections_gets_one_peer_s_share(index):
    """Turns went per connection: 20 pipelining connections of one peer took an
    honest client's p99 from 8 ms to 81 ms. Per peer, the honest client waits
    about a share of that peer per request, whatever its number of connections."""
    with IndexClient(index.url, token=TOKEN, timeout_s=10, heartbeat=False) as client:
        client.connect()
        heartbeat_round_trips(client, 50)  # warm up
        alone = heartbeat_round_trips(client, 600)
        attacker = start_attacker(_PIPELINING, index.url, "127.0.0.2")
        try:
            time.sleep(1.0)  # every connection has its backlog
            attacked = heartbeat_round_trips(client, 600)
        finally:
            stop(attacker)
    base = np.percentile(alone, [50, 90, 99])
    under = np.percentile(attacked, [50, 90, 99])
    figures = "heartbeat p50/p90/p99 alone {:.2f}/{:.2f}/{:.2f} ms, attacked {:.2f}/{:.2f}/{:.2f} ms".format(
        *base, *under)
    print(figures)
    # A heartbeat waits for about one share of the attacker's (shared_turn_s, 0.05 ms) per request:
    # its p50 rose by 0.03-0.09 ms on a quiet 2-core VM, 0.06-0.11 ms with other work on its
    # cores. Turns per connection, twenty shares, raised it by 0.6-1.3 ms. The p90 and p99
    # bounds are generous: on a small machine they are mostly what other processes take from the
    # client (p90 1.8 ms and p99 20 ms with both cores busy, up to 80 ms under heavier load).
    shares_ms = 1000 * ServerLimits().shared_turn_s
    assert under[0] <= base[0] + 6 * shares_ms, figures
    assert under[1] <= 3 * base[1] + 20, figures
    assert under[2] <= 4 * base[2] + 60, figures


async def _honest_client(url: str) -> None:
    """Connect, say hello with the token, send a heartbeat: both answered ok."""
    address = parse_url(url)
    reader, writer = await asyncio.open_connection(address.host, address.port)
    decoder = FrameDecoder()
    try:
        for message in ({"op": "hello", "protocol": PROTOCOL_VERSION, "client": "honest", "token": TOKEN},
                        {"op": "heartbeat"}):  # fmt: skip
            writer.write(encode_frame({"id": 1, **message}))
            replies: list = []
            while not replies:
                chunk = await reader.read(1 << 16)
                if not chunk:
                    raise ConnectionError(f"closed by the index before its answer to {message['op']}")
                replies += decoder.feed(chunk)
            assert replies[0]["ok"], replies[0]
    finally:
        writer.close()


async def _honest_clients(url: str, count: int, timeout_s: float) -> list[BaseException | None]:
    return await asyncio.gather(*(asyncio.wait_for(_honest_client(url), timeout_s) for _ in range(count)),
                                return_exceptions=True)  # fmt: skip


def test_clients_behind_one_address_get_in_whatever_a_neighbour_without_the_token_does(index):
    """A neighbour at the same address (a NAT, hostNetwork pods) sending wrong
    tokens used to close the address at accept: 185-197 of 200 clients were
    kept out; a connect/close flood emptied the address's connection budget
    the same way. Neither may keep a client with the token out."""
    attacker = start_attacker(_WRONG_TOKENS_AND_CONNECT_CLOSE, index.url, "127.0.0.1")
    try:
        time.sleep(1.0)  # the neighbour has spent what it can
        outcomes = asyncio.run(_honest_clients(index.url, 200, timeout_s=10.0))
        alive = attacker.poll() is None
    finally:
        stop(attacker)
    failed = [repr(outcome) for outcome in outcomes if outcome is not None]
    assert alive, "the attacker stopped: the test measured nothing"
    assert not failed, f"{len(failed)} of 200 honest clients failed, e.g. {failed[:3]}"
