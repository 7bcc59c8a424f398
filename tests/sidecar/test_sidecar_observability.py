"""Readiness against a real index, and a real Prometheus server scraping the sidecar and the index."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from sidecar_helpers import SidecarProcess, StatsWriter, run_client

from maru_connector.testing.index_process import IndexProcess, free_port
from maru_core.index.client import IndexClient, IndexRejected
from maru_core.pool import Pool, SlotHeader

PROMETHEUS = shutil.which("prometheus")


@pytest.fixture
def index():
    metrics_port = free_port()
    process = IndexProcess(pool_size="16Mi", extra_args=("--metrics-port", str(metrics_port),
                                                         "--metrics-addr", "127.0.0.1"))  # fmt: skip
    process.metrics_port = metrics_port
    with process:
        yield process


@pytest.fixture
def sidecars():
    started: list[SidecarProcess] = []

    def start(*args, **kwargs) -> SidecarProcess:
        process = SidecarProcess(*args, **kwargs)
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.close()


def test_readyz_follows_the_pool_and_the_index(index, sock_dir, sidecars):
    sock = sock_dir / "maru.sock"
    sidecar = sidecars(index.pool_path, sock, index.url, token_file=index.token_file)
    assert "ready: pool attached, index" in sidecar.wait_ready()
    assert sidecar.get("/healthz") == (200, "ok\n")

    index.kill()
    code, body = sidecar.get("/readyz")
    assert code == 503 and f"index {index.url} unreachable" in body
    assert sidecar.get("/healthz")[0] == 200  # alive, only not ready
    assert run_client(sock, "c1", index.token)["ok"]  # the hand-off does not need the index

    index.start()
    sidecar.wait_ready(timeout_s=10)


def test_readyz_reports_a_token_the_index_refuses(index, sock_dir, sidecars):
    wrong = sock_dir.parent / f"{sock_dir.name}.wrong-token"
    wrong.write_text("not-the-index-token")
    try:
        sidecar = sidecars(index.pool_path, sock_dir / "maru.sock", index.url, token_file=str(wrong))
        code, body = sidecar.get("/readyz")
        assert code == 503 and "refused the sidecar" in body and "auth" in body
    finally:
        wrong.unlink()


# Every metric the sidecar and the index export, with the labels a series must carry.
SIDECAR_LABELS = {"cache": "c1", "namespace": "team-a", "pod": "vllm-0", "job": "sidecar"}
SIDECAR_SERIES = {
    "maru_lookups_total": {},
    "maru_lookup_hit_tokens_total": {},
    "maru_parked_requests": {},
    "maru_load_bytes_total": {},
    "maru_load_duration_seconds_count": {},
    "maru_load_failures_total": {"reason": "timeout"},
    "maru_recomputed_tokens_total": {},
    "maru_layer_wait_seconds_count": {},
    "maru_store_bytes_total": {},
    "maru_store_duration_seconds_count": {},
    "maru_store_failures_total": {"reason": "no_space"},
    "maru_sidecar_pool_attached": {},
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
    prom = _Prometheus(tmp_path, {"sidecar": sidecar.port, "index": index.metrics_port})
    stop, errors = threading.Event(), []
    traffic = threading.Thread(target=_traffic, args=(index, sock_dir, stop, errors), daemon=True)
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
        assert prom.value('maru_keys{job="index"}') >= 1
        assert prom.value('maru_leases{job="index"}') >= 1
        assert prom.value('maru_sidecar_stats_regions{state="live"}') == 1
    finally:
        stop.set()
        traffic.join(timeout=30)
        prom.stop()


def _traffic(index: IndexProcess, sock_dir: Path, stop: threading.Event, errors: list) -> None:
    """A connector's worth of events: hand-offs, index reads and writes, counters in a region."""
    writer = StatsWriter(sock_dir, role="worker")
    client = index.client()
    try:
        _traffic_steps(index, sock_dir, stop, writer, client)
    except Exception as exc:  # reported by the test, not lost in this thread
        errors.append(repr(exc))
    finally:
        client.close()
        writer.kill()


def _traffic_steps(index: IndexProcess, sock_dir: Path, stop: threading.Event, writer, client) -> None:
    assert run_client(sock_dir / "maru.sock", "c1", index.token)["ok"]
    stale = IndexClient(index.url, token="stale", timeout_s=2.0, heartbeat=False)
    with pytest.raises(IndexRejected):  # a connector with a stale token: an error reply the index counts
        stale.heartbeat()
    stale.close()
    writer.do("park 1")
    step = 0
    with Pool.attach(index.pool_path) as pool:
        while not stop.is_set():
            _store_and_read(client, pool, step.to_bytes(16, "little"))
            for command in ("lookup 128", "load 4096 0.003", "load_fail timeout 16", "layer_wait 0.0002",
                            "store 4096 0.004", "store_fail no_space"):  # fmt: skip
                writer.do(command)
            step += 1
            stop.wait(0.2)


def _store_and_read(client: IndexClient, pool: Pool, key: bytes) -> None:
    """One object written and read the way the connector does, so the index's gauges move."""
    (slot,) = client.reserve([(key, 4096)])
    pool.view(slot.offset, 4096)[:] = key * 256
    pool.write_slot_header(slot.offset, SlotHeader(key=key, generation=slot.generation, length=4096))
    assert client.commit([key]) == [True]
    (location,) = client.retrieve([key])
    assert pool.read_slot_header(location.offset).names(key, location.generation)
    assert bytes(pool.view(location.offset, 16)) == key
    client.unpin([key])


class _Prometheus:
    """A real Prometheus server on 127.0.0.1 with a temporary config and storage."""

    def __init__(self, workdir: Path, targets: dict[str, int]):
        self.port = free_port()
        self.workdir = workdir
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
            for job, port in targets.items()
        )
        (workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 500ms, scrape_timeout: 400ms, evaluation_interval: 1s}\n"
            f"scrape_configs:\n{jobs}"
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start:\n{self.log_text()}")
            time.sleep(0.2)

    def query(self, promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as resp:
            answer = json.load(resp)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def wait_for(self, promql: str, timeout_s: float = 30.0, errors: list | None = None) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            assert not errors, f"the traffic failed: {errors}"
            result = self.query(promql)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"no result for {promql} after {timeout_s} s; targets: {self._targets()}")
            time.sleep(0.25)

    def one_series(self, name: str, labels: dict[str, str]) -> dict:
        selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
        result = self.query(f"{name}{{{selector}}}")
        assert len(result) == 1, f"{name}{{{selector}}}: {result}"
        return result[0]

    def value(self, promql: str) -> float:
        result = self.query(promql)
        assert len(result) == 1, f"{promql}: {result}"
        return float(result[0]["value"][1])

    def _targets(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/targets", timeout=5) as resp:
            targets = json.load(resp)["data"]["activeTargets"]
        return "; ".join(f"{t['labels']['job']}: {t['health']} {t.get('lastError', '')}" for t in targets)

    def log_text(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
