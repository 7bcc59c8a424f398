"""A normal client's latency while another process attacks the index.

For each scenario, starts a fresh ``marucache index`` (token auth, a 256 MiB
pool of 4 KiB pages), stores 8,000 keys (held pinned by another client, so
every retrieve hits), then measures a normal ``IndexClient``'s
heartbeat and 8,000-key retrieve (+ unpin) round trips, p50 and p99: first
alone, then while each attack runs in its own process. Also records the
index's resident memory at the end of each scenario, the share of a core it
used while measured (CPU), and whether it lived. Usage (repository root)::

    python bench/index_attacks.py [--seconds 5] [--only NAME ...] [--honest-clients 200] [--out ...]
        [--alternate] [--pin-cores] [--attacker-address 127.0.0.2] [--pods] [--time-budget S]
    python bench/index_attacks.py --loop [--seconds 5] [--only alone NAME ...] [--out ...]
        # instead: the longest event-loop callbacks, and how often callbacks run long, per kind

Each attack is what an unauthenticated peer, a broken client or a client
holding the token could do (see ``ATTACKS``); the index's limits are its
defaults. Every connection of an attacker, raw sockets and ``IndexClient``
alike, comes from another loopback address than the normal client's
(``--attacker-address``, default 127.0.0.2; on Linux every 127.x.y.z is
loopback): another peer, as a hostile pod is. From 127.0.0.1 it would share
the normal client's per-peer budgets and quotas, and its refusals would
refuse the normal client too. The attacks of ``bench/quota_attacks.py`` (a
client with the token: pins without end, reservations never committed,
evictions, connections held, a slow frame) join ``ATTACKS``. The
``*_same_address`` attacks always come from 127.0.0.1, on purpose: a
neighbour behind the normal clients' NAT. With ``--pods`` every client
presents its own pod's credential instead of the token (``credential``: the
normal client, the key holder, each honest client, the attacker), and the
attacks of a token holder (``TOKEN_HOLDER_ATTACKS``) come from 127.0.0.1: a
hostile pod behind the honest pods' own address, told apart by its credential
alone; ``--attacker-address 127.0.0.1`` without it shows the same attacks
with the cache token, one peer with the normal clients. ``--honest-clients
N`` adds N clients behind that address (a heartbeat every 0.5 s each) and
reports how many got in and how many answers a second they got.

``--alternate`` runs the baseline (no attack) before each attack, so each is
judged against a baseline measured just before it; ``--pin-cores`` puts the
index, the attacker, the honest fleet and the normal client on CPUs of their
own, on distinct physical cores where there are enough (see ``core_plan``;
on 2 or 3 CPUs: the index on one, the others on another). ``--time-budget S``
starts no attack whose runs would end past S seconds; the JSON is written
after every scenario, so a run cut short keeps what it measured. Each
scenario also reports the index's resident memory over time (its growth
from before the attack), the CPU time of the index, the attacker and the
fleet, how many of 2,000 objects stored before the attack (not pinned)
are still there after it (the least recently used: any eviction takes them
first) and how many objects the index evicted, and the index's connections
by peer address midway (``peers_connected``, from ``/proc/net/tcp``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import logging
import multiprocessing
import os
import pstats
import shlex
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import numpy as np

from maru_core import pod_credentials
from maru_core.index.client import IndexClient
from maru_core.index.launcher import IndexProcess, unique_shm_path
from maru_core.index.service import freeze_startup_objects
from maru_core.pool import Pool, SlotHeader
from maru_core.protocol import MAX_BATCH_KEYS, PROTOCOL_VERSION, FrameDecoder, encode_frame, pack_lengths, parse_url
from maru_core.protocol.framing import HEADER
from attack_rounds import p99_over_own_baseline
from loop_steps import StepTimer, long_turn_lines, step_lines
from quota_attacks import ATTACKS as TOKEN_ATTACKS
from quota_attacks import Attacker, still_open

TOKEN = "bench-attack-token-0123456789abcdef"
NORMAL_KEYS = 8000
#: Default source address of the attacker's connections (``--attacker-address``).
ATTACKER_ADDRESS = "127.0.0.2"
#: The normal client's and the honest fleet's address (the system's choice for 127.0.0.1).
HONEST_ADDRESS = "127.0.0.1"


# -- attacks (each runs in its own process until `stop` is set) ----------------------------------


def credential(role: str, pods: bool) -> str:
    """What ``role`` presents in ``hello``: the cache token, or with ``--pods`` the credential of a
    pod of its own, ``bench/<role>``. The roles: ``client`` (the normal client, which also stores the
    normal and the kept objects), ``holder`` (keeps the normal objects pinned), ``fleet-N`` (each
    honest client) and ``attacker`` (every connection of an attack that holds the token)."""
    return pod_credentials.mint(TOKEN, f"bench/{role}") if pods else TOKEN


def _connect(url: str, attacker: Attacker) -> socket.socket:
    address = parse_url(url)
    sock = socket.create_connection((address.host, address.port), timeout=10, source_address=(attacker.address, 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _hello(token: str, rid: int = 0) -> bytes:
    return encode_frame({"id": rid, "op": "hello", "protocol": PROTOCOL_VERSION, "client": "attacker", "token": token})


def _drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while sock.recv(1 << 20):
            pass
    except (BlockingIOError, OSError):
        pass
    sock.setblocking(True)


def preauth_memory(url: str, stop, attacker: Attacker) -> None:
    """100 connections each announce a 16 MiB frame and send 6 bytes, before any hello; reconnect when closed."""
    socks = []
    while not stop.is_set():
        while len(socks) < 100:
            try:
                s = _connect(url, attacker)
                s.sendall(HEADER.pack(16 * 1024 * 1024) + b"abcdef")
                socks.append(s)
            except OSError:
                break
        time.sleep(0.2)
        socks = still_open(socks)


def idle_flood(url: str, stop, attacker: Attacker) -> None:
    """Keep 2,000 idle connections open (reopened as the index closes them)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    socks: list[socket.socket] = []
    while not stop.is_set():
        socks = [s for s in socks if s.fileno() >= 0]
        while len(socks) < 2000 and not stop.is_set():
            try:
                socks.append(_connect(url, attacker))
            except OSError:
                time.sleep(0.05)
                break
        for s in list(socks):
            try:
                s.setblocking(False)
                if s.recv(1) == b"":
                    s.close()
            except BlockingIOError:
                pass
            except OSError:
                s.close()
        time.sleep(0.2)


def slowloris(url: str, stop, attacker: Attacker) -> None:
    """200 connections sending one byte of a hello every second."""
    frame = _hello(attacker.token)
    socks = {}
    while not stop.is_set():
        while len(socks) < 200:
            try:
                socks[_connect(url, attacker)] = 0
            except OSError:
                break
        for s, sent in list(socks.items()):
            try:
                s.sendall(frame[sent : sent + 1])
                socks[s] = sent + 1
            except OSError:
                s.close()
                del socks[s]
        stop.wait(1.0)


def _read_until_closed(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 20):
            pass
    except OSError:
        pass


def stats_pipeline(url: str, stop, attacker: Attacker) -> None:
    """One connection (with the token) pipelines stats requests as fast as the index takes them,
    a thread of its own reading the replies all along. (It read them only between batches
    before: the replies piled up until the index stopped reading from it, its ``sendall`` then
    blocked, and the attack paused for seconds in some runs and not in others.)"""
    batch = b"".join(encode_frame({"id": i, "op": "stats"}) for i in range(1, 2001))
    while not stop.is_set():
        try:
            sock = _connect(url, attacker)
        except OSError:
            stop.wait(0.01)
            continue
        reader = threading.Thread(target=_read_until_closed, args=(sock,), daemon=True)
        reader.start()
        try:
            sock.sendall(_hello(attacker.token))
            while not stop.is_set():
                sock.sendall(batch)
        except OSError:
            pass  # closed by the index: connect again
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader (a close would not)
            reader.join()
            sock.close()


def hello_flood(url: str, stop, attacker: Attacker) -> None:
    """One connection pipelines hello after hello (each would open a lease); when the index
    closes it (past --max-leases-per-connection), another at once, as often as it is let in."""
    batch = b"".join(_hello(attacker.token, rid=i) for i in range(500))
    while not stop.is_set():
        try:
            with _connect(url, attacker) as sock:
                while not stop.is_set():
                    sock.sendall(batch)
                    _drain(sock)
        except OSError:
            pass  # closed, or a connection refused by the peer's budget: connect again


def reserve_flood(url: str, stop, attacker: Attacker) -> None:
    """Reserves of 131,072 one-byte objects, one after the other (the first fills the pool with reservations,
    the next find it full of what cannot be evicted). Each batch is new keys: random ones plus the request's
    number (os.urandom of 2 MiB a request took 0.7 of the attacker's core, which on a 2-core machine is the
    normal client's: what it measured was then the attacker's CPU, not the index)."""
    lengths = pack_lengths(np.ones(MAX_BATCH_KEYS, dtype=np.int64))
    base = np.frombuffer(os.urandom(16 * MAX_BATCH_KEYS), dtype=np.uint64)
    sock = _connect(url, attacker)
    sock.sendall(_hello(attacker.token))
    decoder = FrameDecoder()
    rid, sent = 1, 0
    while not stop.is_set():
        try:
            sent += 1
            keys = (base + np.uint64(sent)).tobytes()  # wraps: still 131,072 keys never sent before
            sock.sendall(encode_frame({"id": rid, "op": "reserve", "keys": keys, "lengths": lengths}))
            replies: list = []
            while len(replies) < (2 if rid == 1 else 1):  # the hello's reply comes first
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise ConnectionError("closed")
                replies += decoder.feed(chunk)
            rid += 1
        except OSError:
            time.sleep(0.01)
            sock, decoder, rid = _connect(url, attacker), FrameDecoder(), 1
            sock.sendall(_hello(attacker.token))


def unpin_bye(url: str, stop, attacker: Attacker, pool_path: str) -> None:
    """Pin 100 x 8,000 keys (800,000 pins in one lease), unpin 64 of them (not a retrieve's batch), then bye."""
    keys = _store(url, pool_path, 8000, attacker.token, first=10**7, source_address=attacker.address)
    packed = b"".join(keys)
    while not stop.is_set():
        client = IndexClient(url, token=attacker.token, timeout_s=30, heartbeat=False, source_address=attacker.address)
        for _ in range(100):
            client.retrieve(packed)
        client.unpin(b"".join(keys[::125]))
        client.close()  # bye


def nil_frames(url: str, stop, attacker: Attacker) -> None:
    """16 MiB frames of nils (a msgpack array), with the token, back to back."""
    payload = b"\xdd" + (16 * 1024 * 1024 - 5).to_bytes(4, "big") + b"\xc0" * (16 * 1024 * 1024 - 5)
    frame = HEADER.pack(len(payload)) + payload
    while not stop.is_set():
        try:
            sock = _connect(url, attacker)
            sock.sendall(_hello(attacker.token))
            sock.sendall(frame)
            _drain(sock)
            sock.close()
        except OSError:
            time.sleep(0.01)


def brute_force(url: str, stop, attacker: Attacker) -> None:
    """Wrong-token hellos as fast as possible (the index closes the connection after each)."""
    i = 0
    while not stop.is_set():
        try:
            sock = _connect(url, attacker)
            for _ in range(50):
                sock.sendall(_hello(f"guess-{i}"))
                i += 1
            _drain(sock)
            sock.close()
        except OSError:
            pass


def many_connections_pipelining(url: str, stop, attacker: Attacker) -> None:
    """20 connections with the token, each pipelining stats requests as ``stats_pipeline`` does."""
    threads = [threading.Thread(target=stats_pipeline, args=(url, stop, attacker), daemon=True) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def wrong_token_same_address(url: str, stop, attacker: Attacker) -> None:
    """Two wrong-token hellos a second from the normal clients' address (a neighbour behind
    their NAT), each on its own connection, waiting for its answer."""
    def guess(i: int) -> None:
        try:
            sock = _connect(url, attacker)
            sock.sendall(_hello(f"guess-{i}"))
            sock.recv(1 << 16)
            sock.close()
        except OSError:
            pass

    i = 0
    while not stop.wait(0.5):
        threading.Thread(target=guess, args=(i,), daemon=True).start()
        i += 1


def connect_close_same_address(url: str, stop, attacker: Attacker) -> None:
    """Connections opened and closed at once, as fast as the index takes them, from the normal
    clients' address."""
    while not stop.is_set():
        try:
            _connect(url, attacker).close()
        except OSError:
            pass


ATTACKS = {
    "preauth_memory": preauth_memory,
    "idle_flood": idle_flood,
    "slowloris": slowloris,
    "stats_pipeline": stats_pipeline,
    "hello_flood": hello_flood,
    "reserve_flood": reserve_flood,
    "unpin_bye": unpin_bye,
    "nil_frames": nil_frames,
    "brute_force": brute_force,
    "many_connections_pipelining": many_connections_pipelining,
    "wrong_token_same_address": wrong_token_same_address,
    "connect_close_same_address": connect_close_same_address,
}
ATTACKS.update(TOKEN_ATTACKS)
#: Attacks that also need the pool's path (they write slot headers, as a token holder's pod can).
POOL_ATTACKS = frozenset({"unpin_bye", *TOKEN_ATTACKS})
#: What ``--pin-cores`` gives a CPU of its own each, in this order (see ``core_plan``).
ROLES = ("index", "attacker", "fleet", "client")
#: Objects stored before each attack and not pinned: how many are left after it says what it cost others.
KEPT_KEYS = 2000

#: Attacks from the normal clients' own address (127.0.0.1), whatever ``--attacker-address`` says.
SAME_ADDRESS_ATTACKS = frozenset({"wrong_token_same_address", "connect_close_same_address"})
#: Attacks of a client that holds the token (its hellos succeed): with ``--pods`` a pod of its own,
#: ``bench/attacker``, behind the normal clients' address. The others never get past ``hello``
#: (none, a wrong token, or one byte a second): before it the index knows only the address.
TOKEN_HOLDER_ATTACKS = frozenset({"stats_pipeline", "hello_flood", "reserve_flood", "unpin_bye", "nil_frames",
                                  "many_connections_pipelining", *TOKEN_ATTACKS})  # fmt: skip


def attacker_of(name: str, address: str, pods: bool) -> Attacker:
    """Where attack ``name``'s connections leave from and what they present: ``address``
    (``--attacker-address``), or the normal clients' own for the *_same_address attacks and,
    with ``--pods``, for the token holder's (told apart by its pod credential)."""
    same_address = name in SAME_ADDRESS_ATTACKS or (pods and name in TOKEN_HOLDER_ATTACKS)
    return Attacker(address=HONEST_ADDRESS if same_address else address, token=credential("attacker", pods))


# -- the normal client ---------------------------------------------------------------------------


def _store(url: str, pool_path: str, count: int, token: str, first: int = 0,
           source_address: str | None = None) -> list[bytes]:  # fmt: skip
    keys = [(first + i).to_bytes(16, "little") for i in range(count)]
    with IndexClient(url, token=token, timeout_s=30, source_address=source_address) as client, \
            Pool.attach(pool_path) as pool:  # fmt: skip
        slots = client.reserve([(k, 16) for k in keys])
        for k, slot in zip(keys, slots):
            pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation, length=16))
        assert all(client.commit(keys))
    return keys


RETRIEVE_EVERY_S = 0.05  # the normal client's 8,000-key retrieve, whatever its heartbeats' pace


def measure(url: str, keys: list[bytes], seconds: float, token: str, interval_s: float = 0.01) -> dict:
    """Heartbeats every ``interval_s`` (10 ms) and an 8,000-key retrieve + unpin every 50 ms, for
    ``seconds``. A p99 of few heartbeats is a few samples' worst: 4 s at 10 ms give 350 or so, so one
    host hiccup moves it (``--heartbeat-ms``)."""
    packed = b"".join(keys)
    heartbeats, retrieves, misses, failures = [], [], 0, 0
    with IndexClient(url, token=token, timeout_s=5) as client:
        client.connect()
        end = time.monotonic() + seconds
        next_retrieve = time.monotonic() + RETRIEVE_EVERY_S
        while time.monotonic() < end:
            try:
                t = time.perf_counter()
                client.heartbeat()
                heartbeats.append(time.perf_counter() - t)
                if time.monotonic() >= next_retrieve:
                    next_retrieve += RETRIEVE_EVERY_S
                    t = time.perf_counter()
                    locations = client.retrieve(packed)
                    if locations.misses():
                        misses += 1
                    else:
                        client.unpin(packed)
                    retrieves.append(time.perf_counter() - t)
            except Exception:
                failures += 1
            time.sleep(interval_s)
    return {
        "heartbeat_p50_ms": _pct(heartbeats, 50), "heartbeat_p99_ms": _pct(heartbeats, 99),
        "retrieve_p50_ms": _pct(retrieves, 50), "retrieve_p99_ms": _pct(retrieves, 99),
        "heartbeats": len(heartbeats), "retrieves": len(retrieves), "misses": misses, "failures": failures,
    }  # fmt: skip


def honest_fleet(url: str, tokens: list[str], seconds: float, results) -> None:
    """A client per token (the cache token, or its own pod's credential) behind the normal client's
    address, each connecting and sending a heartbeat every 0.5 s for ``seconds`` (reconnecting by
    itself when refused); puts on ``results`` how many got at least one answer, and the answers per
    second."""
    clients = len(tokens)
    answered = [0] * clients
    failed = [0] * clients
    end = time.monotonic() + seconds

    def client(i: int) -> None:
        with IndexClient(url, token=tokens[i], timeout_s=5, heartbeat=False) as index_client:
            while time.monotonic() < end:
                try:
                    index_client.heartbeat()
                    answered[i] += 1
                except Exception:
                    failed[i] += 1
                time.sleep(0.5)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 15)
    results.put({"fleet_clients_in": sum(1 for n in answered if n), "fleet_clients": clients,
                 "fleet_requests_per_s": round(sum(answered) / seconds, 1), "fleet_failures": sum(failed),
                 "fleet_cpu_s": round(time.process_time(), 2)})


def _pct(samples: list[float], q: int) -> float | None:
    if not samples:
        return None
    return round(1000 * float(np.percentile(samples, q)), 3)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_attack(name: str, url: str, stop, pool_path: str, attacker: Attacker) -> None:
    """Attack ``name`` (in its own process) as ``attacker`` until ``stop`` is set."""
    if name in POOL_ATTACKS:
        ATTACKS[name](url, stop, attacker, pool_path)
    else:
        ATTACKS[name](url, stop, attacker)


def _physical_core(cpu: int) -> tuple[int, int]:
    """The (package, core) of a logical CPU: CPUs that share one are SMT siblings."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
            return int(package.read()), int(core.read())
    except (OSError, ValueError):
        return 0, cpu  # no topology: every CPU a core of its own


def core_plan(cpus: list[int] | None = None) -> dict[str, int]:
    """The CPU of each of ``ROLES`` for ``--pin-cores``, among the CPUs this process may use.

    With a physical core for each role, and one to spare, each gets the first CPU of its
    own physical core and the first core is left to the system (interrupts, the rest of
    the machine); so on a 16-core host the index, the attacker, the honest fleet and the
    normal client never share a core, nor its SMT sibling. With fewer physical cores
    but 4 CPUs, a CPU each; on 2 or 3, the index on one, the others on another."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if len(cpus) < 2:
        raise ValueError(f"--pin-cores needs 2 CPUs or more, this process may use {cpus}")
    cores: dict[tuple[int, int], int] = {}
    for cpu in cpus:
        cores.setdefault(_physical_core(cpu), cpu)
    firsts = list(cores.values())
    if len(firsts) > len(ROLES):
        return dict(zip(ROLES, firsts[1:]))
    if len(firsts) == len(ROLES):
        return dict(zip(ROLES, firsts))
    if len(cpus) >= len(ROLES):
        return dict(zip(ROLES, cpus))
    return {"index": cpus[0], **{role: cpus[1] for role in ROLES[1:]}}


def _pin(pid: int, role: str, cores: dict[str, int] | None) -> None:
    """Every thread of process ``pid`` (those it starts later inherit it) on the role's CPU."""
    if cores is None:
        return
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), {cores[role]})
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def peers_of(url: str) -> dict[str, int]:
    """The index's established TCP connections (IPv4), counted by peer address, from
    ``/proc/net/tcp``: the addresses the index's per-peer accounts key on."""
    port = parse_url(url).port
    peers: dict[str, int] = {}
    with open("/proc/net/tcp") as fh:
        next(fh)
        for line in fh:
            local, remote, state = line.split()[1:4]
            if state != "01" or int(local.split(":")[1], 16) != port:
                continue
            address = socket.inet_ntoa(struct.pack("=I", int(remote.split(":")[0], 16)))
            peers[address] = peers.get(address, 0) + 1
    return peers


class _RssSampler:
    """The index's resident memory every 0.25 s, on a thread, while the scenario runs."""

    def __init__(self, pid: int):
        self.samples: list[float] = []
        self._pid, self._stop = pid, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self.samples.append(_rss_mb(self._pid))
            except OSError:
                return

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.samples


def _kept_left(url: str, keys: list[bytes], token: str) -> int:
    """How many of ``keys`` are still committed (each retrieved alone: a miss pins nothing)."""
    with IndexClient(url, token=token, timeout_s=30, heartbeat=False) as client:
        left = 0
        for key in keys:
            if client.retrieve(key).misses() == 0:
                client.unpin(key)
                left += 1
    return left


def scenario(name: str, seconds: float, token_file: str, source: str, honest_clients: int = 0,
             cores: dict[str, int] | None = None, pods: bool = False, heartbeat_s: float = 0.01,
             index_args: Sequence[str] = ()) -> dict:  # fmt: skip
    """A fresh index (its defaults, but for ``index_args``), the normal keys stored and held pinned, the attack (if any) running, the figures
    (with ``honest_clients``, also those of a fleet of clients behind the normal client's address;
    with ``pods``, each client presents its own pod's credential: see ``credential``)."""
    pool_path = unique_shm_path("bench-attacks")
    index = IndexProcess(pool_path, pool_size="256Mi", token_file=token_file,
                         extra_args=["--page-size", "4Ki", "--log-level", "ERROR", *index_args]).start()  # fmt: skip
    _pin(index.proc.pid, "index", cores)
    ctx = multiprocessing.get_context("spawn")
    stop, attacker = ctx.Event(), None
    try:
        keys = _store(index.url, pool_path, NORMAL_KEYS, credential("client", pods))
        kept = _store(index.url, pool_path, KEPT_KEYS, credential("client", pods), first=10**8)
        # keeps the normal keys pinned: always a hit
        holder = IndexClient(index.url, token=credential("holder", pods), timeout_s=30)
        holder.retrieve(b"".join(keys))
        rss = _RssSampler(index.proc.pid)
        rss_before = _rss_mb(index.proc.pid)
        if name != "alone":
            who = attacker_of(name, source, pods)
            attacker = ctx.Process(target=_run_attack, args=(name, index.url, stop, pool_path, who), daemon=True)
            attacker.start()
            _pin(attacker.pid, "attacker", cores)
            time.sleep(1.0)  # let the attack build up
        cpu_before = _cpu_s(index.proc.pid)
        attacker_cpu_before = _cpu_s(attacker.pid) if attacker is not None else 0.0
        fleet, fleet_results = None, ctx.Queue()
        if honest_clients:
            tokens = [credential(f"fleet-{i}", pods) for i in range(honest_clients)]
            fleet = ctx.Process(target=honest_fleet, args=(index.url, tokens, seconds, fleet_results))
            fleet.start()
            _pin(fleet.pid, "fleet", cores)
        peers: dict[str, int] = {}
        census = threading.Timer(seconds / 2, lambda: peers.update(peers_of(index.url)))  # mid-measurement
        census.start()
        try:
            figures = measure(index.url, keys, seconds, credential("client", pods), heartbeat_s)
        except Exception as exc:  # the index stopped answering altogether
            figures = {"error": f"{type(exc).__name__}: {exc}"}
        if attacker is not None and attacker.is_alive():
            figures["attacker_cpu_share"] = round((_cpu_s(attacker.pid) - attacker_cpu_before) / seconds, 3)
        if fleet is not None:
            figures.update(fleet_results.get(timeout=seconds + 30))
            fleet.join(10)
        if index.proc.poll() is None:
            figures["index_cpu_share"] = round((_cpu_s(index.proc.pid) - cpu_before) / seconds, 3)
        samples = rss.stop()
        figures["index_rss_mb"] = _rss_mb(index.proc.pid) if index.proc.poll() is None else None
        figures["index_rss_growth_mb"] = round(max(samples, default=rss_before) - rss_before, 1)
        figures["index_rss_mb_over_time"] = samples
        figures["index_alive"] = index.proc.poll() is None
        census.join()
        figures["peers_connected"] = peers
        if name != "alone":
            figures["attacker_address"] = who.address
        stop.set()  # the attack ends before what it left is counted
        if attacker is not None:
            attacker.join(10)
        if figures["index_alive"]:
            figures["kept_lost"] = KEPT_KEYS - _kept_left(index.url, kept, credential("client", pods))
            # Eviction takes the least recently used first, whoever stored them: the kept objects, older
            # than anything an attack stores, go at its first evictions. The count says how far it went.
            figures["index_evictions"] = holder.stats()["evictions"]
        holder.close()
    finally:
        stop.set()
        if attacker is not None:
            attacker.join(10)
            if attacker.is_alive():
                attacker.kill()
        index.stop()
        os.unlink(pool_path)
    return figures


#: Wall-time thresholds of the long callbacks ``--loop`` counts: a heartbeat that arrives while one
#: runs waits for the rest of it, so how often they come, not the longest, sets a p99 of 0.15 ms.
LONG_CALLBACK_MS = (0.1, 0.2, 0.5)
#: Seconds an attack runs before the normal client starts (and ``--loop`` starts counting), as in ``scenario``.
BUILD_UP_S = 1.0


def _callback_kind(callback) -> str:
    """What an event-loop callback runs, in short: its qualified name (a task's: its coroutine's;
    a transport's: with its connection's peer, as the normal client's own requests delay none
    of its heartbeats)."""
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        return f"task {getattr(owner.get_coro(), '__qualname__', '?')}"
    what = getattr(callback, "__qualname__", type(callback).__name__)
    protocol = getattr(owner, "_protocol", None)  # a transport's
    return f"{what} of {getattr(protocol, 'peer_key', '?')}" if protocol else what


def longest_callbacks(name: str, seconds: float, source: str, pods: bool = False, profile_top: int = 0,
                      steps_top: int = 0) -> dict:  # fmt: skip
    """The five longest event-loop callbacks of an index (in this process) while the attack runs
    (in another) and the normal client (in a third) keeps the index contended, as honest clients
    do: each in CPU milliseconds of the loop's thread, with what ran (what one request or turn
    costs the others, whatever else the machine is running). And, per kind of callback
    (``_callback_kind``), how many a second took longer than each of ``LONG_CALLBACK_MS`` in wall
    time, and their share of the wall time, and of it on the CPU (the rest: the loop's thread
    preempted), counted while the normal client runs: wall time is what a heartbeat waits for.
    ``profile_top``: also the loop thread's ``profile_top`` functions of most own time meanwhile
    (cProfile: what inside those callbacks costs; its overhead inflates every figure above).
    ``steps_top``: also the ``steps_top`` kinds of a connection's turn with the longest 99th
    percentile (``loop_steps.StepTimer``: a sliced request's turns by where its job stood), and
    per peer its turns over ``loop_steps.LONG_TURN_MS``, however rare their kind."""
    from asyncio import events

    from maru_core.index.launcher import ThreadedIndex
    from maru_core.index.quotas import MAX_LEASE_EVICT_FRACTION, MAX_LEASE_PIN_FRACTION
    from maru_core.index.registry import MAX_LEASE_POOL_FRACTION

    durations: list[tuple[float, str]] = []
    long: dict[str, list[float]] = {}  # kind: [count over each threshold..., wall s, CPU s] of those over the first
    counting_from = float("inf")
    run = events.Handle._run

    def timed(handle) -> None:
        callback = handle._callback  # before it runs: a handle that cancels itself forgets it
        started, wall_started = time.thread_time(), time.perf_counter()
        run(handle)
        wall, took = time.perf_counter() - wall_started, time.thread_time() - started
        if took > 2e-4:
            durations.append((took, _callback_kind(callback)))
        if wall > LONG_CALLBACK_MS[0] / 1000 and wall_started >= counting_from:
            counts = long.setdefault(_callback_kind(callback), [0.0] * (len(LONG_CALLBACK_MS) + 2))
            for i, ms in enumerate(LONG_CALLBACK_MS):
                counts[i] += wall > ms / 1000
            counts[-2] += wall
            counts[-1] += took

    steps = StepTimer()
    if steps_top:
        steps.install()
    pool_path = unique_shm_path("bench-attacks-loop")
    pool = Pool.create(pool_path, 256 * 1024 * 1024, page_size=4096)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    logging.getLogger("maru_core").setLevel(logging.ERROR)  # as the served index's --log-level ERROR
    try:
        # the served index's quotas, not ThreadedIndex's (none)
        with ThreadedIndex(pool, token=TOKEN, max_lease_pool_fraction=MAX_LEASE_POOL_FRACTION,
                           max_lease_pin_fraction=MAX_LEASE_PIN_FRACTION,
                           max_lease_evict_fraction=MAX_LEASE_EVICT_FRACTION,
                           max_peer_pool_fraction=MAX_LEASE_POOL_FRACTION, max_peer_pin_fraction=MAX_LEASE_PIN_FRACTION,
                           max_peer_evict_fraction=MAX_LEASE_EVICT_FRACTION) as index:  # fmt: skip
            keys = _store(index.url, pool_path, NORMAL_KEYS, credential("client", pods))
            # As a served index does: else a full collection walks this process's whole heap
            # (numpy, the keys) in the index's thread, and shows as a long callback.
            freeze_startup_objects()
            events.Handle._run = timed
            attacker = None
            if name != "alone":
                who = attacker_of(name, source, pods)
                attacker = ctx.Process(target=_run_attack, args=(name, index.url, stop, pool_path, who), daemon=True)
                attacker.start()
                time.sleep(BUILD_UP_S)
            normal = ctx.Process(target=measure, args=(index.url, keys, seconds, credential("client", pods)),
                                 daemon=True)  # fmt: skip
            profiler = cProfile.Profile() if profile_top else None
            if profiler is not None:
                index.on_loop(profiler.enable)  # cProfile follows the thread that enables it
            steps.counting = True
            counting_from = time.perf_counter()
            normal.start()
            time.sleep(seconds)
            counted_s = time.perf_counter() - counting_from
            counting_from = float("inf")
            steps.counting = False
            if profiler is not None:
                index.on_loop(profiler.disable)
            stop.set()
            for process in (attacker, normal):
                if process is None:
                    continue
                process.join(10)
                if process.is_alive():
                    process.kill()
            events.Handle._run = run
    finally:
        events.Handle._run = run
        steps.uninstall()
        gc.unfreeze()
        pool.close()
        os.unlink(pool_path)
    per_kind = {kind: {**{f"per_s_over_{ms}ms": round(c[i] / counted_s, 1) for i, ms in enumerate(LONG_CALLBACK_MS)},
                       "wall_share": round(c[-2] / counted_s, 4), "cpu_share": round(c[-1] / counted_s, 4)}
                for kind, c in sorted(long.items(), key=lambda item: -item[1][-2])}  # fmt: skip
    return {"longest_ms": [[round(1000 * d, 2), what] for d, what in sorted(durations, reverse=True)[:5]],
            "long_callbacks": per_kind, "profile": _top_functions(profiler, profile_top) if profiler else [],
            "steps": steps.table(steps_top) if steps_top else [],
            "long_turns": steps.long_turns() if steps_top else {}}


def _top_functions(profiler: cProfile.Profile, top: int) -> list[str]:
    """The ``top`` functions of most own time, a line each: own and cumulative ms, calls, where."""
    stats = pstats.Stats(profiler).stats  # (file, line, name): (calls, primitive, own s, cumulative s, callers)
    ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [f"{1000 * own:9.1f} {1000 * cumulative:9.1f} {calls:>8}  {os.path.basename(file)}:{line} {function}"
            for (file, line, function), (_, calls, own, cumulative, _) in ranked]  # fmt: skip


def _long_lines(per_kind: dict) -> str:
    """``longest_callbacks``'s counts per kind, a line each, with their sum."""
    total = {key: round(sum(k[key] for k in per_kind.values()), 4) for key in next(iter(per_kind.values()), {})}
    heading = " ".join(f"{f'>{ms}ms/s':>9}" for ms in LONG_CALLBACK_MS)
    lines = [f"    {'callback (wall time)':58} {heading} {'wall%':>6} {'CPU%':>6}"]
    for kind, k in [*per_kind.items(), *([("all", total)] if total else [])]:
        counts = " ".join(f"{k[f'per_s_over_{ms}ms']:>9g}" for ms in LONG_CALLBACK_MS)
        lines.append(f"    {kind[:58]:58} {counts} {100 * k['wall_share']:>6.2f} {100 * k['cpu_share']:>6.2f}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds measured per scenario (default 5)")
    parser.add_argument("--only", nargs="*", choices=sorted([*ATTACKS, "alone"]),
                        help="run only these attacks (with --loop, 'alone' is a run without one)")
    parser.add_argument("--out", help="write the figures as JSON here (after every scenario)")
    parser.add_argument("--loop", action="store_true",
                        help="measure instead the longest event-loop callbacks (CPU ms) of an index in this process, "
                             "and per kind of callback how many a second run longer than 0.1, 0.2 and 0.5 ms "
                             "(wall time) and their share of the time")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="with --loop: also list the N functions of the index's loop thread with the most "
                             "own time while counting (cProfile, which slows every call it sees)")
    parser.add_argument("--steps", type=int, default=0, metavar="N",
                        help="with --loop: also list the N kinds of a connection's turn with the longest 99th "
                             "percentile (CPU ms), by where its job stood before the turn, and each peer's turns "
                             "over 0.5, 1 and 2 ms (bench/loop_steps.py)")
    parser.add_argument("--honest-clients", type=int, default=0,
                        help="also run this many clients behind the normal client's address, a heartbeat every "
                             "0.5 s each, and report how many got in and their answers per second")
    parser.add_argument("--alternate", action="store_true",
                        help="run the baseline (no attack) before each attack, each judged against the one before it")
    parser.add_argument("--pin-cores", action="store_true",
                        help="index, attacker, honest fleet and normal client each on a CPU of its own, on distinct "
                             "physical cores where there are enough (on 2-3 CPUs: the index on one, the rest on "
                             "another)")
    parser.add_argument("--attacker-address", default=ATTACKER_ADDRESS,
                        help="source address of every attacker connection, raw sockets and IndexClient alike "
                             f"(default {ATTACKER_ADDRESS}: on Linux every 127.x.y.z is loopback, so it is another "
                             "peer than the normal client's 127.0.0.1, as a hostile pod is; from 127.0.0.1 the "
                             "attacker would share the normal client's per-peer quotas, and refusals meant for it "
                             "would refuse the normal client). The *_same_address attacks use 127.0.0.1 whatever "
                             "this says, and with --pods so do the token holder's")
    parser.add_argument("--pods", action="store_true",
                        help="every client presents its own pod's credential, minted from the cache token, instead "
                             "of the token (the normal client bench/client, the key holder bench/holder, each honest "
                             "client bench/fleet-N, the attacker bench/attacker), and the attacks of a token holder "
                             "leave from 127.0.0.1, the honest clients' address: a hostile pod behind their NAT, "
                             "told apart by its credential")
    parser.add_argument("--heartbeat-ms", type=float, default=10.0,
                        help="the normal client's pause between heartbeats (default 10 ms: about 350 in 4 s; "
                             "1 ms gives the p99 ten times the samples)")
    parser.add_argument("--index-args", default="", metavar="ARGS",
                        help="more flags of every 'marucache index' started (one string, e.g. "
                             "\"--peer-receive-rate-mib 64\"), to compare a limit's settings")
    parser.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="start no attack (with its baseline) that would likely end past S seconds from the start")
    return parser


def _check_address(parser: argparse.ArgumentParser, address: str, pods: bool) -> None:
    """The attacker's address must be one this host can send from."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        parser.error(f"--attacker-address {address} cannot be bound on this host ({exc}): give one of its "
                     "addresses, e.g. 127.0.0.2 on Linux")  # fmt: skip
    if pods:
        print(f"pods: every client presents its own pod's credential (bench/client, bench/holder, bench/fleet-N, "
              f"bench/attacker); the token holder's attacks leave from {HONEST_ADDRESS}, the others from "
              f"{address}", flush=True)  # fmt: skip
    elif address == HONEST_ADDRESS:
        print(f"note: the attacker leaves from {HONEST_ADDRESS}, the normal client's address, with the cache "
              "token: one peer", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_address(parser, args.attacker_address, args.pods)
    if "alone" in (args.only or []) and not args.loop:
        parser.error("--only alone is a run without an attack for --loop; every other run has its baseline")
    cores = None
    if args.pin_cores:
        try:
            cores = core_plan()
        except ValueError as exc:
            parser.error(str(exc))
        _pin(os.getpid(), "client", cores)
        print(f"pinned: {cores}", flush=True)
    header = {"machine": os.uname().machine, "python": sys.version.split()[0], "cpus": os.cpu_count(),
              "pinned_cores": cores, "seconds": args.seconds, "attacker_address": args.attacker_address,
              "pods": args.pods, "heartbeat_ms": args.heartbeat_ms,
              "load_average_before": os.getloadavg()}  # fmt: skip
    if args.loop:
        loop_results = {}
        for name in args.only or ATTACKS:
            loop_results[name] = longest_callbacks(name, args.seconds, args.attacker_address, args.pods,
                                                   args.profile, args.steps)  # fmt: skip
            print(f"{name:16} longest callbacks, CPU ms: {loop_results[name]['longest_ms']}", flush=True)
            print(_long_lines(loop_results[name]["long_callbacks"]), flush=True)
            if args.profile:
                print(f"    {'own ms':>9} {'cum ms':>9} {'calls':>8}  the loop thread's functions of most own time",
                      *loop_results[name]["profile"], sep="\n    ", flush=True)  # fmt: skip
            if args.steps:
                print(step_lines(loop_results[name]["steps"]), flush=True)
                print(long_turn_lines(loop_results[name]["long_turns"]), flush=True)
            _write(args.out, {**header, "longest_callbacks_ms": {n: r["longest_ms"] for n, r in loop_results.items()},
                              "long_callbacks": {n: r["long_callbacks"] for n, r in loop_results.items()},
                              "profile": {n: r["profile"] for n, r in loop_results.items() if r["profile"]},
                              "steps": {n: r["steps"] for n, r in loop_results.items() if r["steps"]},
                              "long_turns": {n: r["long_turns"] for n, r in loop_results.items() if r["long_turns"]}})
        return 0
    workdir = tempfile.mkdtemp(prefix="bench-attacks-")
    token_file = os.path.join(workdir, "token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as fh:
        fh.write(TOKEN)
    try:
        _run_all(args, token_file, cores, header)
    finally:
        os.unlink(token_file)
        os.rmdir(workdir)
    return 0


def _run_all(args: argparse.Namespace, token_file: str, cores: dict[str, int] | None, header: dict) -> None:
    """Every scenario in turn, a line each; the JSON rewritten after each (``--out``)."""
    results: dict[str, dict] = {}
    skipped: list[str] = []
    fleet_header = f" {'fleet in':>9} {'fleet req/s':>11}" if args.honest_clients else ""
    print(f"{'scenario':32} {'hb p50':>7} {'hb p99':>7} {'ret p50':>7} {'ret p99':>7} {'fail':>4} {'RSS MB':>7} "
          f"{'+RSS':>6} {'lost':>5} {'CPU':>5}{fleet_header} {'at s':>5}", flush=True)  # fmt: skip
    attacks = list(args.only or ATTACKS)
    groups = [[f"alone#{a}", a] for a in attacks] if args.alternate else [["alone"], *([a] for a in attacks)]
    started, longest = time.monotonic(), 0.0
    for group in groups:
        elapsed = time.monotonic() - started
        if args.time_budget is not None and elapsed + max(longest, len(group) * (args.seconds + 5)) > args.time_budget:
            skipped += [run for run in group if not run.startswith("alone")]
            continue
        for run in group:
            results[run] = f = scenario(run.split("#")[0], args.seconds, token_file, args.attacker_address,
                                        args.honest_clients, cores, args.pods, args.heartbeat_ms / 1000,
                                        shlex.split(args.index_args))  # fmt: skip
            print(_line(run, f, args.honest_clients) + f" {time.monotonic() - started:>5.0f}", flush=True)
            _write(args.out, {**header, "load_average_after": os.getloadavg(), "results": results, "skipped": skipped})
        longest = max(longest, time.monotonic() - started - elapsed)
    if skipped:
        print(f"skipped (--time-budget {args.time_budget:g} s): {' '.join(skipped)}", flush=True)
    if args.alternate:
        print(_p99_ratios(results), flush=True)
    _write(args.out, {**header, "load_average_after": os.getloadavg(), "results": results, "skipped": skipped})


def _p99_ratios(results: dict[str, dict]) -> str:
    """Each attack's heartbeat p99 over its own baseline's and over the median of every baseline's
    (a noisy host shows in the spread of the baselines, not in one of them)."""
    baselines = [f["heartbeat_p99_ms"] for run, f in results.items()
                 if run.startswith("alone#") and "heartbeat_p99_ms" in f]  # fmt: skip
    if not baselines:
        return "no baseline measured"
    median = statistics.median(baselines)
    lines = [f"baselines' heartbeat p99: {min(baselines)}-{max(baselines)} ms, median {median:g} ms",
             f"{'attack':32} {'p99 / own':>9} {'p99 / median':>12}"]
    for run, over_own in p99_over_own_baseline(results).items():
        lines.append(f"{run:32} {over_own:>9.2f} {results[run]['heartbeat_p99_ms'] / median:>12.2f}")
    return "\n".join(lines)


def _line(name: str, f: dict, honest_clients: int) -> str:
    if "error" in f:
        return f"{name:32} {f['error'][:80]} (index alive: {f['index_alive']})"
    fleet = (f" {f['fleet_clients_in']:>5}/{f['fleet_clients']:<3} {f['fleet_requests_per_s']:>11}"
             if honest_clients else "")  # fmt: skip
    return (f"{name:32} {f['heartbeat_p50_ms']!s:>7} {f['heartbeat_p99_ms']!s:>7} {f['retrieve_p50_ms']!s:>7} "
            f"{f['retrieve_p99_ms']!s:>7} {f['failures']:>4} {f['index_rss_mb']!s:>7} "
            f"{f['index_rss_growth_mb']!s:>6} {f.get('kept_lost')!s:>5} {f.get('index_cpu_share')!s:>5}{fleet}")


def _write(path: str | None, figures: dict) -> None:
    """``figures`` as JSON at ``path`` (whole or not at all: written aside, then renamed)."""
    if not path:
        return
    with open(f"{path}.part", "w") as fh:
        json.dump(figures, fh, indent=2)
    os.replace(f"{path}.part", path)


if __name__ == "__main__":
    sys.exit(main())
