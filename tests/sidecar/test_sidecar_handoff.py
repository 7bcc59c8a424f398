"""The pool hand-off between real processes: a sidecar, clients that map the pool, refusals, restarts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from sidecar_helpers import HoldingClient, run_client

from maru_core.handoff import HANDOFF_PROTOCOL, HandoffUnavailable, fetch_pool, recv_frame, send_frame
from maru_core.pool import Pool
from maru_core.stats import ConnectorStats

TOKEN = "s3cret-token-0123456789"
NO_INDEX = "tcp://127.0.0.1:9"  # nothing listens: hand-offs work without the index


@pytest.fixture
def token_file(sock_dir):
    path = sock_dir.parent / f"{sock_dir.name}.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    yield str(path)
    path.unlink()


def test_a_client_process_receives_the_descriptor_and_maps_the_pool(pool, sock_dir, token_file, sidecars):
    sock = sock_dir / "maru.sock"
    sidecars(pool.where, sock, NO_INDEX, token_file=token_file)
    answer = run_client(sock, "c1", TOKEN)
    assert answer["ok"], answer
    assert answer["magic"] == "MARUPOOL"  # read from the client's own mapping
    assert answer["uuid"] == pool.geometry.uuid and answer["size"] == pool.geometry.size
    assert answer["claimed_geometry"] == pool.geometry.to_dict()
    assert answer["index_url"] == NO_INDEX
    assert answer["stats_dir"] == str(sock_dir)
    assert answer["cache"] == "c1"
    assert answer["offset"] == answer["handed_offset"] == 0  # a pool that is its whole file


def test_wrong_token_cache_or_protocol_is_refused_on_both_sides(pool, sock_dir, token_file, sidecars):
    sock = sock_dir / "maru.sock"
    sidecar = sidecars(pool.where, sock, NO_INDEX, token_file=token_file)
    wrong_token = run_client(sock, "c1", "guess")
    assert not wrong_token["ok"] and wrong_token["type"] == "auth"
    assert "token does not match" in wrong_token["message"]
    no_token = run_client(sock, "c1", None)
    assert not no_token["ok"] and no_token["type"] == "auth"
    wrong_cache = run_client(sock, "other", TOKEN)
    assert not wrong_cache["ok"] and wrong_cache["type"] == "wrong_cache"
    assert "serves cache 'c1'" in wrong_cache["message"] and "'other'" in wrong_cache["message"]

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:  # a connector two releases apart
        raw.connect(str(sock))
        send_frame(raw, {"op": "handoff", "protocol": HANDOFF_PROTOCOL + 2, "token": TOKEN, "cache": "c1"})
        reply, fds = recv_frame(raw, max_fds=1)
    assert fds == [] and not reply["ok"] and reply["error"]["type"] == "protocol"
    assert "one release at a time" in reply["error"]["message"]

    log = sidecar.log_text()
    assert log.count("refused the pool") == 4
    assert "token does not match" in log and "asked for 'other'" in log and f"protocol {HANDOFF_PROTOCOL + 2}" in log
    _, metrics = sidecar.get("/metrics")
    assert 'maru_sidecar_handoffs_total{cache="c1",namespace="local",pod=' in metrics
    assert _sample(metrics, "maru_sidecar_handoffs_total", 'result="auth"') == 2
    assert _sample(metrics, "maru_sidecar_handoffs_total", 'result="wrong_cache"') == 1
    assert _sample(metrics, "maru_sidecar_handoffs_total", 'result="protocol"') == 1
    assert _sample(metrics, "maru_sidecar_handoffs_total", 'result="ok"') == 0
    assert _sample(metrics, "maru_sidecar_handoffs_total", 'result="send_failed"') == 0  # there from the start


def test_a_connector_of_the_next_release_is_handed_the_pool_in_this_protocol(pool, sock_dir, token_file, sidecars):
    """A rolling upgrade: the vLLM image (the connector) may be a release ahead of the sidecar's
    image; the sidecar hands it the pool in its own protocol, which the next release speaks."""
    sock = sock_dir / "maru.sock"
    sidecars(pool.where, sock, NO_INDEX, token_file=token_file)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(sock))
        send_frame(raw, {"op": "handoff", "protocol": HANDOFF_PROTOCOL + 1, "token": TOKEN, "cache": "c1"})
        reply, fds = recv_frame(raw, max_fds=1)
    try:
        assert reply["ok"] and reply["protocol"] == HANDOFF_PROTOCOL and len(fds) == 1
        assert reply["pool_offset"] == 0 and reply["cache"] == "c1"
    finally:
        for fd in fds:
            os.close(fd)


def test_sidecar_killed_and_restarted_while_a_client_reads_through_its_mapping(
    pool, sock_dir, token_file, sidecars, stats_writers
):
    sock = sock_dir / "maru.sock"
    sidecar = sidecars(pool.where, sock, NO_INDEX, token_file=token_file)
    client = HoldingClient(sock, "c1", TOKEN)
    try:
        assert client.info["ok"], client.info
        writer = stats_writers(sock_dir)  # a connector process reporting through the shared directory
        writer.do("lookup 512")
        assert _sample(sidecar.get("/metrics")[1], "maru_lookup_hit_tokens_total") == 512

        port = sidecar.port
        sidecar.kill()  # SIGKILL: no cleanup, the socket file stays behind
        assert sock.exists()
        offset = pool.geometry.data_offset
        for round_ in range(3):  # the client keeps reading live shared memory while no sidecar runs
            pattern = os.urandom(64)
            pool.view(offset, 64)[:] = pattern
            assert client.ask(f"read {offset} 64") == pattern.hex(), f"round {round_}"
        assert client.ask("magic") == "MARUPOOL"
        with pytest.raises(HandoffUnavailable, match="no sidecar listens"):
            fetch_pool(str(sock), TOKEN, "c1", timeout_s=1.0)
        writer.do("lookup 8")  # counters keep accumulating meanwhile

        restarted = sidecars(pool.where, sock, NO_INDEX, token_file=token_file, port=port)
        assert "removing the stale socket" in restarted.log_text()
        assert run_client(sock, "c1", TOKEN)["ok"]
        metrics = restarted.get("/metrics")[1]
        assert _sample(metrics, "maru_lookup_hit_tokens_total") == 520  # reporting resumed, nothing lost
        assert _sample(metrics, "maru_lookups_total") == 2
        pattern = os.urandom(64)
        pool.view(offset, 64)[:] = pattern
        assert client.ask(f"read {offset} 64") == pattern.hex()
    finally:
        client.close()


def test_sigterm_shuts_down_cleanly_and_removes_the_socket(pool, sock_dir, sidecars):
    sock = sock_dir / "maru.sock"
    sidecar = sidecars(pool.where, sock, NO_INDEX)
    assert run_client(sock, "c1", None)["ok"]  # no --token-file: no auth
    assert sidecar.terminate() == 0
    assert not sock.exists()
    assert "shutting down" in sidecar.log_text()


def test_pool_created_after_the_sidecar_started(pool_path, sock_dir, sidecars):
    sock = sock_dir / "maru.sock"
    sidecar = sidecars(pool_path, sock, NO_INDEX)
    with pytest.raises(HandoffUnavailable, match="not attached yet"):
        fetch_pool(str(sock), None, "c1", timeout_s=2.0)
    code, body = sidecar.get("/readyz")
    assert code == 503 and "pool not attached" in body
    with Pool.create(pool_path, size=8 * 1024 * 1024) as created:
        deadline = time.monotonic() + 10
        while True:
            try:
                handoff = fetch_pool(str(sock), None, "c1", timeout_s=2.0)
                break
            except HandoffUnavailable:
                assert time.monotonic() < deadline, sidecar.log_text()
                time.sleep(0.2)
        assert handoff.geometry["uuid"] == created.geometry.uuid
        with handoff.open_pool() as mapped:
            assert mapped.geometry == created.geometry
        with pytest.raises(OSError):
            os.fstat(handoff.fd)  # consumed by open_pool


def test_a_second_sidecar_on_the_same_socket_is_refused(pool, sock_dir, sidecars):
    sock = sock_dir / "maru.sock"
    sidecars(pool.where, sock, NO_INDEX)
    out = subprocess.run(
        [sys.executable, "-m", "maru_core.cli", "sidecar", "--pool", pool.where, "--socket", str(sock),
         "--index", NO_INDEX, "--metrics-port", "0", "--metrics-host", "127.0.0.1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 2
    assert "another sidecar already serves" in out.stderr
    assert run_client(sock, "c1", None)["ok"]  # the first one is untouched


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--index", "http://x"], "expected tcp://HOST:PORT or unix:///PATH"),
        (["--token-file", "/nonexistent/token"], "--token-file /nonexistent/token: cannot read it"),
        (["--metrics-port", "70000"], "expected 0..65535"),
        (["--pool-offset", "3Mi"], "--pool-offset 3Mi: pool offset 3145728 is not a multiple of 2 MiB"),
        (["--pool-offset", "lots"], "--pool-offset lots: 'lots' is not a size"),
    ],
)
def test_bad_settings_exit_with_a_message_naming_the_flag(sock_dir, flags, message):
    base = {"--pool": "/dev/shm/none", "--socket": str(sock_dir / "s.sock"), "--index": NO_INDEX}
    for flag, value in zip(flags[::2], flags[1::2]):
        base[flag] = value
    argv = [item for pair in base.items() for item in pair]
    out = subprocess.run([sys.executable, "-m", "maru_core.cli", "sidecar", *argv],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_stats_region_written_after_a_handoff_lands_in_the_handed_directory(pool, sock_dir, sidecars):
    sock = sock_dir / "maru.sock"
    sidecars(pool.where, sock, NO_INDEX)
    handoff = fetch_pool(str(sock), None, "c1", timeout_s=5.0)
    os.close(handoff.fd)
    with ConnectorStats(handoff.stats_dir, role="scheduler") as stats:
        assert stats.path.parent == sock_dir


def _sample(metrics_text: str, name: str, label_filter: str = "") -> float:
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") and label_filter in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label_filter} not in /metrics:\n{metrics_text}")


def test_fetch_pool_waits_for_a_sidecar_that_starts_after_it(pool, sock_dir, sidecars):
    sock = sock_dir / "maru.sock"
    result: dict = {}

    def fetch() -> None:
        try:
            result["handoff"] = fetch_pool(str(sock), None, "c1", timeout_s=20.0)
        except Exception as exc:  # reported below
            result["error"] = exc

    waiter = threading.Thread(target=fetch)
    waiter.start()
    time.sleep(0.5)  # the vLLM container came up first
    assert waiter.is_alive() and not result
    sidecars(pool.where, sock, NO_INDEX)
    waiter.join(timeout=20)
    assert "error" not in result, result
    with result["handoff"].open_pool() as mapped:
        assert mapped.geometry.uuid == pool.geometry.uuid


def test_a_sidecar_folds_what_it_saw_alive_and_no_region_put_there(pool, sock_dir, sidecars, stats_writers):
    sidecar = sidecars(pool.where, sock_dir / "maru.sock", NO_INDEX)
    honest = stats_writers(sock_dir)
    honest.do("lookup 7")
    key = ("maru_lookup_hit_tokens_total", (("cache", "c1"),))

    def hit_tokens() -> float:
        return next(v for (name, _), v in sidecar.metrics().items() if name == key[0])

    assert hit_tokens() == 7.0  # the scrape saw the writer alive
    honest.kill()
    injected = ConnectorStats(sock_dir)  # a region no writer will hold: made-up counters
    injected.record_lookup(9 * 10**15)
    injected.close()
    deadline = time.monotonic() + 20
    while injected.path.exists() and time.monotonic() < deadline:  # the sidecar's own scans remove it
        time.sleep(0.1)
    assert not injected.path.exists()
    assert hit_tokens() == 7.0
    removed = [v for (name, _), v in sidecar.metrics().items() if name == "maru_sidecar_stats_regions_unattested_total"]
    assert removed == [1.0]
