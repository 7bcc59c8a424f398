"""The index as a real process on loopback, with real client processes."""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maru_core.index.cli import add_arguments, server_limits
from maru_core.index.client import IndexClient, IndexRejected
from maru_core.index.launcher import IndexProcess, unique_shm_path
from maru_core.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION, FrameDecoder, encode_frame, parse_url
from maru_core.quickstart import prompt_keys

TOKEN = "process-token-0123456789"
ROLE_ARGS = ["--tokens", "1024", "--chunk-tokens", "128", "--layers", "4", "--object-size", "65536"]


@pytest.fixture
def index(pool_path, token_file):
    proc = IndexProcess(pool_path, pool_size="64Mi", token_file=token_file,
                        extra_args=["--lease-ttl", "0.5", "--metrics-port", "0", "--metrics-addr", "127.0.0.1"])
    with proc.start():
        yield proc


def role(name: str, index: IndexProcess, pool_path: str, token_file: str) -> dict:
    cmd = [sys.executable, "-m", "maru_core.quickstart", name, "--url", index.url, "--pool", pool_path,
           "--token-file", token_file, *ROLE_ARGS]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_writer_and_reader_processes_exchange_bytes(index, pool_path, token_file):
    writer = role("writer", index, pool_path, token_file)
    reader = role("reader", index, pool_path, token_file)
    assert writer["committed"] == writer["objects"] == 32
    assert writer["pid"] != reader["pid"]
    assert (reader["matched"], reader["hits"], reader["verified"]) == (32, 32, 32)
    with IndexClient(index.url, token=TOKEN) as client:
        stats = client.stats()
        assert stats["keys"] == 32 and stats["pinned_keys"] == 0 and stats["reserved_keys"] == 0


KILLED_CLIENT = textwrap.dedent("""
    import sys, time
    from maru_core.index.client import IndexClient
    from maru_core.pool import Pool, SlotHeader
    url, pool_path, token = sys.argv[1:4]
    keys = [bytes([i]) * 16 for i in range(1, 9)]
    with Pool.attach(pool_path) as pool:
        client = IndexClient(url, token=token)
        slots = client.reserve([(k, 4096) for k in keys[:4]])
        for k, s in zip(keys, slots):
            pool.write_slot_header(s.offset, SlotHeader(key=k, generation=s.generation, length=4096))
        assert client.commit(keys[:4]) == [True] * 4
        assert client.retrieve(keys[:4]).misses() == 0   # 4 pins
        assert None not in client.reserve([(k, 4096) for k in keys[4:]])  # 4 reservations
        print("ready", flush=True)
        time.sleep(60)
""")


def test_sigkilled_client_leaves_no_pin_or_reservation(index, pool_path):
    child = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, index.url, pool_path, TOKEN],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with IndexClient(index.url, token=TOKEN) as client:
            stats = client.stats()
            assert (stats["pinned_keys"], stats["reserved_keys"], stats["leases"]) == (4, 4, 2)
            child.send_signal(signal.SIGKILL)
            child.wait()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                stats = client.stats()
                if stats["leases"] == 1:
                    break
                time.sleep(0.1)
            assert (stats["pinned_keys"], stats["reserved_keys"], stats["leases"]) == (0, 0, 1)
            assert stats["keys"] == 4  # committed objects stay
    finally:
        child.kill()
        child.wait()


def test_restarted_index_answers_the_same_lookups(pool_path, token_file):
    first = IndexProcess(pool_path, pool_size="64Mi", token_file=token_file, extra_args=["--lease-ttl", "0.5"])
    with first.start():
        role("writer", first, pool_path, token_file)
        with IndexClient(first.url, token=TOKEN) as client:
            keys = prompt_keys(1024, 128, 4)
            before = list(client.retrieve(keys))
            client.unpin(keys)
    first.kill()  # a crash, not a clean stop
    second = IndexProcess(pool_path, token_file=token_file, extra_args=["--lease-ttl", "0.5"])
    with second.start():
        with IndexClient(second.url, token=TOKEN) as client:
            assert client.match_prefix(keys) == 32
            assert list(client.retrieve(keys)) == before
            client.unpin(keys)
        reader = role("reader", second, pool_path, token_file)
        assert reader["verified"] == 32


def test_a_restarted_index_refuses_stores_as_quarantined(pool_path, token_file):
    """Over the wire a restart's refusal has a type of its own, apart from a
    full pool's ``no_space``, so connectors count it apart."""
    first = IndexProcess(pool_path, pool_size="64Mi", token_file=token_file)
    with first.start():
        role("writer", first, pool_path, token_file)
    first.kill()
    second = IndexProcess(pool_path, token_file=token_file, extra_args=["--lease-ttl", "5"])
    with second.start():
        with IndexClient(second.url, token=TOKEN) as client:
            with pytest.raises(IndexRejected, match="restarted") as info:
                client.reserve([(bytes(range(16)), 4096)])
            assert info.value.error_type == "quarantined"
            assert client.match_prefix(prompt_keys(1024, 128, 4)) == 32  # reads are served


def test_bad_token_is_refused(index):
    for token in (None, "wrong"):
        with IndexClient(index.url, token=token) as client:
            with pytest.raises(IndexRejected) as info:
                client.match_prefix([bytes(16)])
            assert info.value.error_type == "auth"


def test_metrics_serve_the_documented_names(index):
    with IndexClient(index.url, token=TOKEN) as client:
        client.retrieve([bytes(16)])
    with IndexClient(index.url, token="wrong") as bad:
        with pytest.raises(IndexRejected):
            bad.connect()
    body = urllib.request.urlopen(index.metrics_url.replace("0.0.0.0", "127.0.0.1"), timeout=5).read().decode()
    for line in [
        "maru_pool_capacity_bytes ",
        'maru_pool_bytes{state="free"} ',
        'maru_pool_bytes{state="reserved"} ',
        'maru_pool_bytes{state="committed"} ',
        'maru_pool_bytes{state="pinned"} ',
        "maru_keys 0.0",
        "maru_evictions_total 0.0",
        "maru_leases ",
        'maru_index_rpc_duration_seconds_bucket{le="0.001",op="retrieve"} ',
        'maru_index_rpc_duration_seconds_count{op="hello"} ',
        'maru_index_rpc_errors_total{op="hello",type="auth"} 1.0',
        "process_resident_memory_bytes ",
        'maru_index_gc_pause_seconds_count{generation="2"} ',
    ]:
        assert line in body, line


# -- fuzzing a live index ----------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_index(tmp_path_factory):
    path = unique_shm_path("test-fuzz")
    token_file = tmp_path_factory.mktemp("fuzz") / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    proc = IndexProcess(path, pool_size="16Mi", token_file=str(token_file)).start()
    client = IndexClient(proc.url, token=TOKEN, timeout_s=5)
    client.connect()
    yield proc, client
    client.close()
    proc.stop()
    os.unlink(path)


def _send_and_drain(url: str, data: bytes) -> list:
    """Send ``data`` on a fresh connection; return the replies read until the index closes or goes quiet."""
    address = parse_url(url)
    decoder, replies = FrameDecoder(), []
    with socket.create_connection((address.host, address.port), timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                replies += decoder.feed(chunk)
        except (ConnectionResetError, BrokenPipeError):
            pass
    return replies


def _still_serving(proc: IndexProcess, client: IndexClient) -> None:
    assert proc.proc.poll() is None
    assert client.match_prefix([bytes(16)]) == 0


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
ops = st.sampled_from(["hello", "heartbeat", "match_prefix", "retrieve", "unpin", "reserve", "commit",
                       "abort", "stats", "bye", "nope", ""])
fields = st.sampled_from(["keys", "lengths", "token", "client", "lease_id", "protocol", "extra"])
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.binary(min_size=1, max_size=300))
def test_random_bytes_close_only_that_connection(fuzz_index, data):
    proc, client = fuzz_index
    _send_and_drain(proc.url, data)
    _still_serving(proc, client)


@FUZZ
@given(op=ops, args=st.dictionaries(fields, values, max_size=4), hello_first=st.booleans())
def test_wrong_types_get_typed_error_replies(fuzz_index, op, args, hello_first):
    proc, client = fuzz_index
    frames = b""
    if hello_first:
        frames += encode_frame({"id": 1, "op": "hello", "protocol": PROTOCOL_VERSION, "client": "fuzz", "token": TOKEN})
    frames += encode_frame({"id": 2, "op": op, **args})
    replies = _send_and_drain(proc.url, frames)
    assert replies[-1]["id"] == 2
    if not replies[-1]["ok"]:
        assert replies[-1]["error"]["type"] in {"bad_request", "unknown_op", "auth", "too_large", "no_lease",
                                                "no_space"}
    _still_serving(proc, client)


@FUZZ
@given(length=st.integers(MAX_FRAME_BYTES + 1, 2**32 - 1), tail=st.binary(max_size=64))
def test_huge_lengths_are_refused(fuzz_index, length, tail):
    proc, client = fuzz_index
    replies = _send_and_drain(proc.url, length.to_bytes(4, "big") + tail)
    assert replies and replies[0]["error"]["type"] == "too_large"
    _still_serving(proc, client)


# -- the command line ----------------------------------------------------------

def marucache(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maru_core.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_the_fairness_and_budget_flags_set_the_server_s_limits():
    """What ``marucache index`` is told reaches ``ServerLimits`` in the unit it means."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    required = ["--pool", "/dev/shm/unused", "--listen", "tcp://127.0.0.1:0"]
    args = parser.parse_args([*required, "--turn-ms", "2", "--shared-turn-ms", "0.1",
                              "--peer-receive-rate-mib", "16", "--peer-receive-burst-mib", "8"])
    limits = server_limits(args)
    assert (limits.turn_s, limits.shared_turn_s) == (0.002, 0.0001)
    assert (limits.peer_receive_rate, limits.peer_receive_burst) == (16 << 20, 8 << 20)
    defaults = server_limits(parser.parse_args(required))
    assert (defaults.turn_s, defaults.shared_turn_s) == (0.001, 0.00005)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "12X"], "is not a size"),
        (["--listen", "localhost:80", "--pool-size", "64Mi"], "tcp://HOST:PORT"),
        (["--listen", "tcp://127.0.0.1:0", "--lease-ttl", "0"], "positive number of seconds"),
        (["--listen", "tcp://127.0.0.1:0"], "pass --pool-size to create one"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--token-file", "/nonexistent/t"], "cannot read"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--metrics-port", "70000"], "0 to 65535"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--lease-ttl", "inf"], "positive number"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--reservation-ttl", "nan"], "positive number"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--max-connections", "0"], "at least 1"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--max-evict-fraction", "1.5"], "fraction"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--log-level", "bogus"], "--log-level"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--metrics-addr", "a b"], "not an address"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--peer-connection-rate", "0"], "per second"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--peer-auth-failure-rate", "inf"], "per second"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--peer-connection-burst", "0"], "at least 1"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--peer-auth-failure-burst", "x"], "at least 1"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--peer-receive-rate-mib", "-5"], "per second"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--peer-receive-burst-mib", "0"], "at least 1"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--shared-turn-ms", "0"], "milliseconds"),
        (["--listen", "tcp://127.0.0.1:0", "--pool-size", "64Mi", "--turn-ms", "nan"], "milliseconds"),
    ],
)
def test_bad_flags_say_what_to_change(pool_path, args, words):
    done = marucache("index", "--pool", pool_path, *args)
    assert done.returncode == 2 and words in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # one line, no usage block or traceback
    assert not os.path.exists(pool_path)


@pytest.mark.parametrize(
    "content, mode, words",
    [("a-token-long-enough-0123", 0o644, "open to other users"), ("x", 0o600, "at least 16")],
)
def test_unsafe_token_files_are_refused(pool_path, tmp_path, content, mode, words):
    token = tmp_path / "token"
    token.write_text(content)
    token.chmod(mode)
    done = marucache("index", "--pool", pool_path, "--pool-size", "16Mi", "--listen", "tcp://127.0.0.1:0",
                     "--token-file", str(token))  # fmt: skip
    assert done.returncode == 2 and words in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_metrics_follow_the_listen_host_and_an_open_index_without_token_is_warned_about(pool_path, tmp_path):
    local = IndexProcess(pool_path, pool_size="16Mi", listen=f"unix://{tmp_path}/i.sock",
                         extra_args=["--metrics-port", "0"]).start()  # fmt: skip
    try:
        assert local.metrics_url.startswith("http://127.0.0.1:")  # not every interface by default
    finally:
        local.stop()
    proc = subprocess.Popen([sys.executable, "-m", "maru_core.cli", "index", "--pool", pool_path,
                             "--listen", "tcp://0.0.0.0:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert "listening on" in proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "no --token-file: anyone who can reach tcp://0.0.0.0" in err


def test_the_index_freezes_its_start_up_objects_before_it_serves(pool_path):
    """A full collection walks every tracked object in the event loop's thread: the index
    freezes what start-up built, so it walks only what serving creates."""
    proc = subprocess.Popen([sys.executable, "-m", "maru_core.cli", "index", "--pool", pool_path, "--pool-size",
                             "16Mi", "--listen", "tcp://127.0.0.1:0", "--log-level", "DEBUG"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert "listening on" in proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    frozen = [line for line in err.splitlines() if "start-up objects frozen" in line]
    assert len(frozen) == 1, err
    assert int(frozen[0].split(": ", 1)[1].split()[0]) > 10_000  # modules, classes, functions


def test_gc_pauses_are_timed_by_generation_until_closed():
    from prometheus_client import CollectorRegistry, Histogram

    from maru_core.index.metrics import GcPauses

    registry = CollectorRegistry()

    def counts() -> list[float | None]:
        return [registry.get_sample_value("pauses_count", {"generation": str(g)}) for g in range(3)]

    automatic = gc.isenabled()
    gc.disable()  # a collection of its own before the first look would count
    try:
        pauses = GcPauses(Histogram("pauses", "", ["generation"], registry=registry))
        assert counts() == [0, 0, 0]  # every series from the start
    finally:
        if automatic:
            gc.enable()
    try:
        gc.collect(1)
        gc.collect()
    finally:
        pauses.close()
    timed = counts()
    assert timed[1] >= 1 and timed[2] >= 1  # (a collection of its own may run meanwhile)
    assert registry.get_sample_value("pauses_sum", {"generation": "2"}) > 0
    gc.collect()
    assert counts() == timed  # closed: not timed any more


def test_a_taken_metrics_port_is_named_as_the_metrics_port(pool_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = marucache("index", "--pool", pool_path, "--pool-size", "16Mi", "--listen", "tcp://127.0.0.1:0",
                         "--metrics-port", str(port), "--metrics-addr", "127.0.0.1")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr
    os.unlink(pool_path)


def test_a_unix_listener_refuses_a_path_that_is_not_its_stale_socket(pool_path, tmp_path):
    regular = tmp_path / "not-a-socket"
    regular.write_text("precious")
    done = marucache("index", "--pool", pool_path, "--pool-size", "16Mi", "--listen", f"unix://{regular}")
    assert done.returncode == 1 and "not a socket" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert regular.read_text() == "precious"
    os.unlink(pool_path)
    sock = tmp_path / "index.sock"
    with IndexProcess(pool_path, pool_size="16Mi", listen=f"unix://{sock}"):
        second = marucache("index", "--pool", pool_path, "--listen", f"unix://{sock}")
        assert second.returncode == 1 and "another process is listening" in second.stderr
        with IndexClient(f"unix://{sock}", timeout_s=5) as client:  # the first index still has its socket
            assert client.match_prefix([bytes(16)]) == 0
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))
    stale.close()  # a socket file nobody listens on: taken over
    with IndexProcess(pool_path, listen=f"unix://{sock}"), IndexClient(f"unix://{sock}", timeout_s=5) as client:
        assert client.match_prefix([bytes(16)]) == 0


def test_sigterm_stops_cleanly_and_removes_the_socket(pool_path, tmp_path):
    sock = tmp_path / "index.sock"
    proc = IndexProcess(pool_path, pool_size="16Mi", listen=f"unix://{sock}").start()
    assert sock.exists()
    assert proc.stop() == 0
    assert not sock.exists()
