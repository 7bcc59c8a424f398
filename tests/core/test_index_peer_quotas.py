"""One token holder with many leases against another peer, on a real index
process with its default quotas: four leases over four connections of one
peer pin, reserve and evict no more than one peer's share, a ``bye`` and
``hello`` does not give it a fresh eviction window, and a client of another
peer (127.0.0.2 over loopback) keeps working and keeps its objects."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest
from quota_objects import OBJECT, numbered, store

from maru_core.index.client import IndexClient
from maru_core.index.client_ops import IndexRejected
from maru_core.pool import Pool
from maru_tools.index_process import IndexProcess, free_port

HONEST_ADDRESS = "127.0.0.2"  # another peer than the hog's 127.0.0.1


@contextlib.contextmanager
def connecting_from(source: str) -> Iterator[None]:
    """TCP connections opened meanwhile (in this process) leave from ``source``."""
    real = socket.create_connection

    def create_connection(address, timeout=None, source_address=None, **kwargs):  # type: ignore[no-untyped-def]
        return real(address, timeout, (source, 0), **kwargs)

    socket.create_connection = create_connection  # type: ignore[assignment]
    try:
        yield
    finally:
        socket.create_connection = real  # type: ignore[assignment]


def honest_client(index: IndexProcess) -> IndexClient:
    client = index.client()
    with connecting_from(HONEST_ADDRESS):
        client.connect()
    return client


def _refusals(metrics_port: int, quota: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    line = next(line for line in text.splitlines()
                if line.startswith(f'maru_index_quota_refusals_total{{quota="{quota}"}}'))  # fmt: skip
    return float(line.split()[-1])


def serve(*args: str) -> tuple[IndexProcess, int]:
    """An index process (4 KiB pages, 32 MiB) and its metrics port, apart from its own
    (``free_port`` may name one port twice while nothing listens on it)."""
    port = metrics_port = free_port()
    while metrics_port == port:
        metrics_port = free_port()
    args = ("--page-size", "4Ki", "--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1", *args)
    return IndexProcess(pool_size="32Mi", port=port, extra_args=args), metrics_port


def test_four_leases_of_one_peer_pin_no_more_than_its_share():
    """Before, each lease had half the pool to pin and half to hold reserved:
    a client with two leases took all of it from the others."""
    process, metrics_port = serve()
    with process as index, Pool.attach(index.pool_path) as pool:
        honest = honest_client(index)
        hogs = [index.client() for _ in range(4)]  # four connections of 127.0.0.1, a lease each
        try:
            pages = pool.geometry.num_pages
            share = pages // 2  # the default share of a lease, and of a peer
            hogged, mine = numbered(1, int(0.6 * pages)), numbered(2, 200)
            for start in range(0, len(hogged), 1000):
                store(honest, pool, hogged[start : start + 1000])
            store(honest, pool, mine)
            quarter = len(hogged) // 4  # each lease pins well within its own quota
            pinned, refused = 0, None
            for i, hog in enumerate(hogs):
                for start in range(i * quarter, (i + 1) * quarter, 250):
                    try:
                        hog.retrieve(hogged[start : min(start + 250, (i + 1) * quarter)])
                    except IndexRejected as exc:
                        refused = exc
                        break
                    pinned += min(250, (i + 1) * quarter - start)
                    assert honest.retrieve(mine).misses() == 0 and honest.unpin(mine) == len(mine)
                if refused:
                    break
            assert refused is not None and refused.error_type == "quota", pinned
            assert "--max-peer-pin-fraction" in refused.message and "peer 127.0.0.1" in refused.message
            assert share - 250 < pinned <= share
            assert honest.retrieve(mine).misses() == 0 and honest.unpin(mine) == len(mine)
            assert _refusals(metrics_port, "peer_pins") >= 1
            assert _refusals(metrics_port, "pins") == 0  # no lease passed its own
            assert "quota peer_pins of client" in index.log_path.read_text()  # logged (a line per 10 s at most)
        finally:
            for client in (honest, *hogs):
                client.close()


def test_four_leases_of_one_peer_hold_no_more_reserved_than_its_share():
    process, metrics_port = serve()
    with process as index, Pool.attach(index.pool_path) as pool:
        honest = honest_client(index)
        hogs = [index.client() for _ in range(4)]
        try:
            pages, refused = pool.geometry.num_pages, None
            mine = numbered(2, 200)
            store(honest, pool, mine)
            reserved = []
            for n, hog in enumerate(hogs):  # a fifth of the pool each, uncommitted
                try:
                    slots = hog.reserve([(k, OBJECT) for k in numbered(10 + n, pages // 5)])
                    reserved.append(sum(slot is not None for slot in slots))
                except IndexRejected as exc:
                    refused = exc
                    break
            assert refused is not None and refused.error_type == "quota", reserved
            assert "--max-peer-pool-fraction" in refused.message
            assert sum(reserved) <= pages // 2 and len(reserved) == 3, reserved  # the third one cut short
            more = numbered(3, 200)
            store(honest, pool, more)  # the other peer still stores
            assert honest.retrieve(mine + more).misses() == 0 and honest.unpin(mine + more) == 400
            assert _refusals(metrics_port, "peer_reservations") >= 2  # cut short, then refused
            assert _refusals(metrics_port, "reservations") == 0
        finally:
            for client in (honest, *hogs):
                client.close()


def test_one_peers_leases_evict_no_more_than_its_window_and_a_new_lease_does_not_reset_it():
    """Before, the window was a lease's: four leases, or one lease closed and
    opened again, evicted a quarter of the pool each per window."""
    process, metrics_port = serve("--evict-window", "60")
    with process as index, Pool.attach(index.pool_path) as pool:
        honest = honest_client(index)
        wipers = [index.client() for _ in range(4)]
        try:
            page, pages = pool.geometry.page_size, pool.geometry.num_pages
            theirs = numbered(1, int(0.94 * pages))  # just under the high watermark
            for start in range(0, len(theirs), 100):  # a step's stores at a time, as an engine stores
                store(honest, pool, theirs[start : start + 100], length=page)
            assert any(wipers[0].reserve([(k, page) for k in numbered(10, pages // 2)]))  # its quarter
            refusals = []
            for n, wiper in enumerate(wipers[1:]):  # other leases, other connections, one peer
                try:
                    wiper.reserve([(k, page) for k in numbered(11 + n, pages // 4)])
                except IndexRejected as exc:
                    refusals.append(exc)
            for wiper in wipers:
                wiper.close()  # bye
            wipers = [index.client()]  # hello: a fresh lease of the same peer
            try:
                wipers[0].reserve([(k, page) for k in numbered(20, pages // 4)])
            except IndexRejected as exc:
                refusals.append(exc)
            assert len(refusals) == 4, refusals
            assert all(exc.error_type == "quota" and "--max-peer-evict-fraction" in exc.message
                       for exc in refusals)  # fmt: skip
            kept = honest.stats()["keys"]  # the wipers committed nothing: every key is the honest peer's
            assert kept >= len(theirs) - pages // 4 - 1, (kept, len(theirs))
            store(honest, pool, numbered(2, 100), length=page)  # its own window: it still stores
            assert _refusals(metrics_port, "peer_evictions") >= 4
        finally:
            for client in (honest, *wipers):
                client.close()


@pytest.mark.parametrize("flag", ["--max-peer-pool-fraction", "--max-peer-pin-fraction", "--max-peer-evict-fraction"])
def test_a_bad_peer_quota_flag_is_refused_naming_it(flag):
    from maru_tools.index_process import unique_pool_path

    run = subprocess.run([sys.executable, "-m", "maru_core.cli", "index", "--pool", unique_pool_path(),
                          "--pool-size", "16Mi", "--listen", "tcp://127.0.0.1:0", flag, "0"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and flag in run.stderr and "'0' is not a" in run.stderr
