"""Real processes for the sidecar tests: stats writers, sidecars, hand-off clients, a Prometheus server,
and connector-like traffic (also used by tests/chart to check dashboard queries)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from maru_tools.index_process import IndexProcess, free_port
from maru_tools.sidecar_process import SidecarProcess
from maru_core.index.client import IndexClient, IndexRejected
from maru_core.pool import Pool, SlotHeader

HERE = Path(__file__).parent
PROMETHEUS = shutil.which("prometheus")


class StatsWriter:
    """A separate process that owns one stats region (tests/sidecar/stats_writer.py)."""

    def __init__(self, directory: Path, role: str = "worker"):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "stats_writer.py"), str(directory), role],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        first = self.proc.stdout.readline().split()
        if not first or first[0] != "ready":
            raise RuntimeError(f"stats writer did not start: {first}")
        self.path = Path(first[1])

    def do(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"stats writer: {command!r} -> {answer!r}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()



def run_client(socket_path: Path, cache: str, token: str | None) -> dict:
    """Run tests/sidecar/handoff_client.py once; its JSON answer."""
    out = subprocess.run(
        [sys.executable, str(HERE / "handoff_client.py"), str(socket_path), cache, token or "-"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"hand-off client failed:\n{out.stderr}")
    return json.loads(out.stdout.splitlines()[0])


class HoldingClient:
    """A hand-off client that keeps its mapping and reads through it on request."""

    def __init__(self, socket_path: Path, cache: str, token: str | None):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "handoff_client.py"), str(socket_path), cache, token or "-", "--hold"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.info = json.loads(self.proc.stdout.readline())

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


def connector_traffic(index: IndexProcess, sock_dir: Path, stop: threading.Event, errors: list) -> None:
    """A connector's worth of events: hand-offs, index reads and writes, counters in a region."""
    writer = StatsWriter(sock_dir, role="worker")
    client = index.client()
    try:
        traffic_steps(index, sock_dir, stop, writer, client)
    except Exception as exc:  # reported by the test, not lost in this thread
        errors.append(repr(exc))
    finally:
        client.close()
        writer.kill()


def traffic_steps(index: IndexProcess, sock_dir: Path, stop: threading.Event, writer, client) -> None:
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


class PrometheusServer:
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
