"""Readiness against a real index, and a real Prometheus server scraping the sidecar and the index."""

from __future__ import annotations

import threading

import pytest
from sidecar_helpers import PROMETHEUS, PrometheusServer, connector_traffic, run_client

from maru_tools.cluster import wait_until
from maru_tools.index_process import IndexProcess, free_port


@pytest.fixture
def index():
    metrics_port = free_port()
    process = IndexProcess(pool_size="16Mi", extra_args=("--metrics-port", str(metrics_port),
                                                         "--metrics-addr", "127.0.0.1"))  # fmt: skip
    process.metrics_port = metrics_port
    with process:
        yield process


def _index_reachable(sidecar) -> float | None:
    """The sidecar's `maru_sidecar_index_reachable` (None before its first probe)."""
    return next((v for (name, _), v in sidecar.metrics().items() if name == "maru_sidecar_index_reachable"), None)


def test_readyz_means_the_handoff_works_and_never_depends_on_the_index(index, sock_dir, sidecars):
    """An index restart or node drain must not take vLLM pods out of their Service (vLLM recomputes)."""
    sock = sock_dir / "maru.sock"
    sidecar = sidecars(index.pool_path, sock, index.url, token_file=index.token_file)
    assert f"ready: pool attached, hand-off served on {sock}" in sidecar.wait_ready()
    assert sidecar.get("/healthz") == (200, "ok\n")
    wait_until(lambda: _index_reachable(sidecar) == 1, 15, what="the index probed")

    index.kill()
    wait_until(lambda: _index_reachable(sidecar) == 0, 15, what="the index seen unreachable")
    code, body = sidecar.get("/readyz")
    assert code == 200 and f"index {index.url} unreachable" in body
    assert run_client(sock, "c1", index.token)["ok"]  # the hand-off does not need the index
    assert "unreachable" in sidecar.log_text()  # logged once when it changed

    index.start()
    wait_until(lambda: _index_reachable(sidecar) == 1, 15, what="the index seen back")
    assert sidecar.get("/readyz")[0] == 200


def test_readyz_fails_when_the_handoff_socket_is_gone(index, sock_dir, sidecars):
    sock = sock_dir / "maru.sock"
    sidecar = sidecars(index.pool_path, sock, index.url, token_file=index.token_file)
    sidecar.wait_ready()
    sock.unlink()  # e.g. removed from the shared volume: connectors can no longer reach it
    code, body = sidecar.get("/readyz")
    assert code == 503 and f"hand-off socket {sock} is gone" in body


def test_a_token_the_index_refuses_is_reported_but_keeps_the_pod_ready(index, sock_dir, sidecars):
    wrong = sock_dir.parent / f"{sock_dir.name}.wrong-token"
    wrong.write_text("not-the-index-token")
    wrong.chmod(0o600)
    try:
        sidecar = sidecars(index.pool_path, sock_dir / "maru.sock", index.url, token_file=str(wrong))
        wait_until(lambda: _index_reachable(sidecar) == 0, 15, what="the index probed")
        code, body = sidecar.get("/readyz")
        assert code == 200 and "refused the sidecar" in body and "auth" in body
    finally:
        wrong.unlink()


def test_an_index_serving_another_pool_is_reported_but_keeps_the_pod_ready(index, sock_dir, sidecars):
    """The sidecar's pool is not the index's (e.g. the cache moved): the connector refuses that index, and
    the sidecar's probe says why; the hand-off, and so the pod, stays ready."""
    with IndexProcess(pool_size="16Mi") as other:  # a pool of the same size, another UUID
        sidecar = sidecars(other.pool_path, sock_dir / "maru.sock", index.url, token_file=index.token_file)
        sidecar.wait_ready()
        wait_until(lambda: _index_reachable(sidecar) == 0, 15, what="the index probed")
        code, body = sidecar.get("/readyz")
        assert code == 200 and "refused the sidecar" in body and "wrong_pool" in body and "serves pool" in body


# Every metric the sidecar and the index export, with the labels a series must carry.
SIDECAR_LABELS = {"cache": "c1", "namespace": "team-a", "pod": "vllm-0", "job": "sidecar"}
SIDECAR_SERIES = {
    "maru_lookups_total": {},
    "maru_lookup_hit_tokens_total": {},
    "maru_parked_requests": {},
    "maru_parked_loads_total": {},
    "maru_early_pinned_loads_total": {},
    "maru_head_start_loads_total": {},
    "maru_load_bytes_total": {},
    "maru_load_duration_seconds_count": {},
    "maru_load_failures_total": {"reason": "timeout"},
    "maru_recomputed_tokens_total": {},
    "maru_layer_wait_seconds_count": {},
    "maru_store_bytes_total": {},
    "maru_store_duration_seconds_count": {},
    "maru_store_failures_total": {"reason": "no_space"},
    "maru_sidecar_pool_attached": {},
    "maru_sidecar_index_reachable": {},
    "maru_sidecar_handoffs_total": {"result": "ok"},
    "maru_sidecar_stats_regions": {"state": "live"},
}
INDEX_SERIES = {
    "maru_pool_capacity_bytes": {},
    "maru_pool_bytes": {"state": "committed"},
    "maru_keys": {},
    "maru_evictions_total": {},
    "maru_leases": {},
    "maru_index_rpc_duration_seconds_count": {"op": "commit"},
    "maru_index_rpc_errors_total": {"op": "hello", "type": "auth"},
}


def test_prometheus_scrapes_every_metric_of_the_sidecar_and_the_index(index, sock_dir, sidecars, tmp_path):
    assert PROMETHEUS, "prometheus is not installed: run scripts/bootstrap.sh (apt-get install -y prometheus)"
    sidecar = sidecars(index.pool_path, sock_dir / "maru.sock", index.url, token_file=index.token_file,
                       env={"POD_NAMESPACE": "team-a", "POD_NAME": "vllm-0"})  # fmt: skip
    prom = PrometheusServer(tmp_path, {"sidecar": sidecar.port, "index": index.metrics_port})
    stop, errors = threading.Event(), []
    traffic = threading.Thread(target=connector_traffic, args=(index, sock_dir, stop, errors), daemon=True)
    try:
        prom.start()
        traffic.start()
        prom.wait_for(
            'maru_store_failures_total{job="sidecar",reason="no_space"} > 0 '
            'and on() (maru_keys{job="index"} > 0) and on() (maru_sidecar_handoffs_total{result="ok"} > 0)',
            errors=errors,
        )
        prom.wait_for('maru_index_rpc_errors_total{op="hello",type="auth"} > 0', errors=errors)
        assert not errors, errors
        for name, labels in SIDECAR_SERIES.items():
            series = prom.one_series(name, labels)
            for key, value in SIDECAR_LABELS.items():
                assert series["metric"].get(key) == value, (name, series)
            assert float(series["value"][1]) >= 0
        for name, labels in INDEX_SERIES.items():
            series = prom.one_series(name, {**labels, "job": "index"})
            assert float(series["value"][1]) >= 0
        # Plausible values, not only present ones.
        assert prom.value('maru_sidecar_pool_attached{job="sidecar"}') == 1
        assert prom.value("maru_lookup_hit_tokens_total / maru_lookups_total") == 128
        assert prom.value("maru_load_bytes_total / maru_load_duration_seconds_count") == 4096
        assert prom.value("maru_recomputed_tokens_total / ignoring(reason) maru_load_failures_total{reason='timeout'}") == 16
        median = prom.value("histogram_quantile(0.5, maru_load_duration_seconds_bucket)")
        assert 0.001 < median <= 0.01  # every load recorded 3 ms
        assert prom.value("maru_layer_wait_seconds_sum / maru_layer_wait_seconds_count") == pytest.approx(2e-4)
        assert prom.value("maru_parked_requests") == 1
        assert prom.value('maru_pool_capacity_bytes{job="index"}') > 0
        assert prom.value('maru_pool_bytes{state="committed"}') >= 4096
        assert prom.value('maru_pool_bytes{state="free"} <= on() maru_pool_capacity_bytes') >= 0
        # the pool-fill query of docs/metrics.md, as written there
        assert 0 < prom.value('maru_pool_bytes{state="committed"} / ignoring (state) maru_pool_capacity_bytes') <= 1
        assert prom.value('maru_keys{job="index"}') >= 1
        assert prom.value('maru_leases{job="index"}') >= 1
        assert prom.value('maru_sidecar_stats_regions{state="live"}') == 1
    finally:
        stop.set()
        traffic.join(timeout=30)
        prom.stop()
