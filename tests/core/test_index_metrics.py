"""The index's error series exist at zero from start-up, so `rate()` sees an index's first error."""

from __future__ import annotations

import os
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from maru_core.index.client import IndexClient, IndexRejected
from maru_core.index.launcher import IndexProcess, unique_shm_path
from maru_core.index.metrics import RPC_ERROR_TYPES, RPC_OPS, IndexMetrics
from maru_core.protocol import OPS, PROTOCOL_VERSION, ErrorType, FrameDecoder, encode_frame, parse_url

TOKEN = "metrics-token-0123456789"


def _error_series(text: str) -> dict[tuple[str, str], float]:
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "maru_index_rpc_errors"]
    return {(s.labels["op"], s.labels["type"]): s.value for s in family.samples if s.name.endswith("_total")}


def test_every_op_and_error_type_of_the_protocol_has_a_series_at_zero_before_any_request():
    metrics = IndexMetrics(lambda: None, 1 << 20, process_metrics=False)
    assert set(RPC_OPS) == {*OPS, "invalid"}
    # every type but wrong_pool, a refusal the clients make themselves (no index sends it)
    assert set(RPC_ERROR_TYPES) == {t.value for t in ErrorType} - {ErrorType.WRONG_POOL.value}
    for op in RPC_OPS:
        for error_type in RPC_ERROR_TYPES:
            value = metrics.registry.get_sample_value("maru_index_rpc_errors_total", {"op": op, "type": error_type})
            assert value == 0.0, (op, error_type)
    metrics.observe_rpc("hello", 0.001, "auth")
    assert metrics.registry.get_sample_value("maru_index_rpc_errors_total", {"op": "hello", "type": "auth"}) == 1.0


@pytest.fixture
def index(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    pool = unique_shm_path("test-metrics")
    proc = IndexProcess(pool, pool_size="16Mi", token_file=str(token_file),
                        extra_args=["--metrics-port", "0", "--metrics-addr", "127.0.0.1"])  # fmt: skip
    with proc.start():
        yield proc
    os.unlink(pool)


def _scrape(index: IndexProcess) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(index.metrics_url, timeout=5) as resp:
        return _error_series(resp.read().decode())


def _send(url: str, *messages: dict) -> list:
    address = parse_url(url)
    decoder, replies = FrameDecoder(), []
    with socket.create_connection((address.host, address.port), timeout=5) as sock:
        sock.sendall(b"".join(encode_frame(m) for m in messages))
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            replies += decoder.feed(chunk)
    return replies


def test_a_live_index_exports_the_closed_set_from_the_start_and_counts_into_it(index):
    before = _scrape(index)
    expected = {(op, error_type) for op in RPC_OPS for error_type in RPC_ERROR_TYPES}
    assert set(before) == expected and not any(before.values())

    with pytest.raises(IndexRejected):
        IndexClient(index.url, token="wrong", heartbeat=False).connect()
    hello = {"id": 1, "op": "hello", "protocol": PROTOCOL_VERSION, "client": "metrics-test", "token": TOKEN}
    replies = _send(
        index.url,
        {"id": 2, "op": "retrieve", "keys": [bytes(16)]},  # before hello: no lease
        hello,
        {"id": 3, "op": "compact"},  # no such op
        {"id": 4, "op": "retrieve", "keys": "not keys"},
        {"id": 5},  # no op at all
    )
    assert [r["error"]["type"] for r in replies if not r["ok"]] == ["no_lease", "unknown_op", "bad_request",
                                                                    "bad_request"]  # fmt: skip

    after = _scrape(index)
    assert set(after) == expected  # the server labels nothing outside the closed set
    counted = {pair: value for pair, value in after.items() if value}
    # A request that does not parse (ill-typed field, no op) is labelled op="invalid".
    assert counted == {("hello", "auth"): 1.0, ("retrieve", "no_lease"): 1.0, ("invalid", "unknown_op"): 1.0,
                       ("invalid", "bad_request"): 2.0}  # fmt: skip
