"""The sidecar against hostile, broken or slow neighbours: who may connect to
the hand-off socket, token files others can read, slow clients, and files in
the stats directory that are no stats region."""

from __future__ import annotations

import mmap
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sidecar_helpers import SidecarProcess, run_client

import maru_sidecar.handoff_server as handoff_server
from maru_core import stats
from maru_core.handoff import fetch_pool
from maru_core.stats_aggregate import RegionAggregator
from maru_sidecar.handoff_server import HandoffServer, PoolOffer
from test_sidecar_handoff import NO_INDEX, TOKEN


def sidecar_cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maru_core.cli", "sidecar", *flags],
                          capture_output=True, text=True, timeout=30)  # fmt: skip


def test_the_socket_is_0660_and_given_the_group_asked_for(pool, sock_dir):
    sock = sock_dir / "maru.sock"
    group = 65534 if os.getgid() != 65534 else 0  # any group but our own shows the chown happened
    sidecar = SidecarProcess(pool.where, sock, NO_INDEX)
    sidecar.cmd += ["--socket-group", str(group)]
    sidecar.start()
    try:
        st = os.stat(sock)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == group
        assert run_client(sock, "c1", None)["ok"]  # its owner still connects
    finally:
        sidecar.close()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--socket-group", "no-such-group-here"], "--socket-group no-such-group-here: no such group"),
        (["--log-level", "bogus"], "--log-level bogus"),
        (["--index-timeout", "-1"], "--index-timeout -1.0"),
        (["--index-timeout", "inf"], "--index-timeout inf"),
        (["--metrics-port", "x"], "--metrics-port"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(sock_dir, flags, message):
    out = sidecar_cli("--pool", "/dev/shm/none", "--socket", str(sock_dir / "s.sock"), "--index", NO_INDEX, *flags)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("content, mode, message", [(TOKEN, 0o644, "open to other users"), ("short", 0o600, "at least 16")])
def test_unsafe_token_files_are_refused(sock_dir, content, mode, message):
    token = sock_dir / "token"
    token.write_text(content)
    token.chmod(mode)
    out = sidecar_cli("--pool", "/dev/shm/none", "--socket", str(sock_dir / "s.sock"), "--index", NO_INDEX,
                      "--token-file", str(token))  # fmt: skip
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_token_open_to_others_is_read_from_a_read_only_mount_only(sock_dir, monkeypatch):
    # A Kubernetes Secret volume is a read-only mount only the pod's containers
    # see; the webhook mounts the token 0444 there for the non-root sidecar and vLLM.
    from maru_sidecar import config as sidecar_config

    token = sock_dir / "token"
    token.write_text(TOKEN)
    token.chmod(0o444)
    cfg = sidecar_config.SidecarConfig(
        pool_path=Path("/dev/shm/none"), pool_offset=0, socket_path=sock_dir / "s.sock", index_url=NO_INDEX,
        token_file=token, cache="c", namespace="n", pod="p", metrics_host="127.0.0.1", metrics_port=0,
        index_timeout_s=1.0,
    )
    with pytest.raises(sidecar_config.ConfigError, match="open to other users"):
        cfg.read_token()
    real_statvfs = os.statvfs

    class ReadOnly:
        def __init__(self, path):
            self.f_flag = real_statvfs(path).f_flag | os.ST_RDONLY

    monkeypatch.setattr(sidecar_config.os, "statvfs", ReadOnly)
    assert cfg.read_token() == TOKEN


@pytest.fixture
def server(pool, sock_dir, monkeypatch):
    monkeypatch.setattr(handoff_server, "CONNECTION_TIMEOUT_S", 0.5)
    offer = PoolOffer(fd=pool.fileno(), geometry=pool.geometry.to_dict(), pool_path=pool.where)
    server = HandoffServer(sock_dir / "maru.sock", cache="c1", index_url=NO_INDEX, stats_dir=sock_dir,
                           offer=lambda: offer, read_token=lambda: None)  # fmt: skip
    server.start()
    yield server
    server.stop()


def test_a_client_that_trickles_its_request_is_cut_off_at_the_deadline(server):
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(str(server.socket_path))
    started = time.monotonic()
    try:
        while time.monotonic() - started < 5:
            conn.sendall(b"\x00")  # a byte well within each recv's timeout, never a whole request
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert time.monotonic() - started < 3  # cut at the 0.5 s deadline, not after 5 s of trickling
    assert server.results["bad_request"] == 1
    conn.close()


def test_slow_clients_take_no_thread(server):
    # Compare the threads themselves, not their count: threads that earlier
    # tests left winding down may end meanwhile and hide a new one.
    before = set(threading.enumerate())
    idle = []
    for _ in range(40):
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(str(server.socket_path))
        idle.append(conn)
    time.sleep(0.2)
    assert set(threading.enumerate()) - before == set()
    assert run_client(server.socket_path, "c1", None)["ok"]  # served while they wait
    for conn in idle:
        conn.close()


def test_a_flood_of_idle_connections_never_keeps_a_connector_from_its_pool(server, monkeypatch):
    """Before, 16 serving threads held 2 s each by idle connections made every
    hand-off of a 5 s client fail. Now each connector is answered as soon as
    its request is in, however many idle connections a local peer keeps open
    (past the cap, the oldest idle one goes)."""
    monkeypatch.setattr(handoff_server, "MAX_PENDING_HANDOFFS", 64)
    stop = threading.Event()
    held: list[socket.socket] = []

    def flood() -> None:
        while not stop.is_set():
            conn = socket.socket(socket.AF_UNIX)
            try:
                conn.connect(str(server.socket_path))
            except OSError:
                conn.close()
                continue
            held.append(conn)
            if len(held) > 300:
                held.pop(0).close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        time.sleep(0.3)
        took = []
        for _ in range(5):
            started = time.monotonic()
            handoff = fetch_pool(str(server.socket_path), None, "c1", timeout_s=5.0)  # raises if refused
            os.close(handoff.fd)
            took.append(time.monotonic() - started)
        # Every one answered well within its 5 s (before: 5 of 5 failed); most at once.
        assert max(took) < 4.0 and sorted(took)[2] < 0.5, took
    finally:
        stop.set()
        flooder.join()
        for conn in held:
            conn.close()


def test_a_fifo_named_like_a_region_neither_blocks_nor_breaks_a_scan(tmp_path):
    os.mkfifo(tmp_path / f"{stats.REGION_PREFIX}fifo{stats.REGION_SUFFIX}")
    with stats.ConnectorStats(tmp_path) as live:
        live.record_lookup(5)
        done: dict = {}
        scanner = threading.Thread(target=lambda: done.update(aggregate=RegionAggregator(tmp_path).scan()), daemon=True)
        scanner.start()
        scanner.join(5)
        assert not scanner.is_alive(), "the scan blocked on the FIFO"
        aggregate = done["aggregate"]
        assert aggregate.invalid == 1 and aggregate.live == 1
        assert stats.decode(aggregate.values)["counters"]["lookups"] == 1


def _corrupt(path: Path, slot: int, value: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, stats.REGION_BYTES) as buffer:
            struct.pack_into("<q", buffer, stats.HEADER_BYTES + 8 * slot, value)
    finally:
        os.close(fd)


@pytest.mark.parametrize("value", [2**63 - 1, -1])
def test_a_region_with_a_bad_value_is_skipped_and_counted(tmp_path, value):
    for _ in range(2):  # two finished processes whose counters would overflow once folded together
        finished = stats.ConnectorStats(tmp_path)
        finished.record_lookup(1)
        finished.close()
        _corrupt(finished.path, stats.SLOT_INDEX["counter:lookups"], value)
    with stats.ConnectorStats(tmp_path) as live:
        live.record_lookup(2)
        _corrupt(live.path, stats.SLOT_INDEX["counter:store_bytes"], value)
        aggregate = RegionAggregator(tmp_path).scan()
        assert aggregate.invalid == 3 and aggregate.live == 0  # skipped, not summed, not folded
        assert stats.decode(aggregate.values)["counters"]["store_bytes"] == 0
