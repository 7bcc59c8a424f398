"""The real operator started from the chart's own Deployment args and TLS Secret against kmock,
with every API call it makes recorded (used by tests/chart/conftest.py)."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import requests
from helm_tools import one, operator_args

from maru_tools.index_process import free_port
from maru_operator.cli import add_arguments, options_from_args
from maru_tools.kube_emulator import KmockCluster, OperatorThread

TEST_AGENT = "marucache-chart-test"  # the test's own requests carry it; the operator's do not
CACHES = "/apis/maru.io/v1alpha1/namespaces/{ns}/marucaches"
NODES = {
    "cxl-1": ({"maru.io/cxl": "true"},
              {"maru.io/dax-devices": json.dumps([{"path": "/dev/dax0.0", "size": "16Gi", "uuid": "cxl-a"}])}),
    "shm-1": ({"maru.io/shm": "true"}, {"maru.io/shm-size": "8Gi"}),
}


@dataclasses.dataclass
class OperatorRun:
    """The chart-configured operator, live for the session."""

    cluster: KmockCluster
    operator: OperatorThread
    docs: list[dict[str, Any]]  # the chart rendered with default values
    webhook_url: str  # https://127.0.0.1:PORT/inject
    webhook_host: str  # the name in the chart's certificate (the Service's DNS name)
    ca_file: pathlib.Path  # the chart's caBundle, PEM
    metrics_port: int
    calls: list[tuple[str, str, dict[str, str]]] = dataclasses.field(default_factory=list)

    def kube(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        resp = requests.request(method, self.cluster.url + path, timeout=30,
                                data=None if body is None else json.dumps(body),
                                headers={"Content-Type": content_type, "User-Agent": TEST_AGENT})
        if resp.status_code == 404:
            return None
        assert resp.status_code < 400, f"{method} {path}: {resp.status_code} {resp.text[:500]}"
        return resp.json()

    def operator_calls(self) -> list[tuple[str, str, dict[str, str]]]:
        """(method, path, query) of every request the operator (kopf and `k8s.py`) has sent so far."""
        def snapshot() -> list[tuple[str, str, dict[str, str]]]:
            return [(r.method.value, r.url.path, dict(r.params)) for r in self.cluster.emulator
                    if r.headers.get("User-Agent") != TEST_AGENT]
        return self.cluster.call(snapshot)


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return result


def chart_options(docs: list[dict[str, Any]], tmp: pathlib.Path, kubeconfig: pathlib.Path) -> Any:
    """The operator's options parsed from the chart's Deployment args, with the TLS Secret written where
    the Deployment mounts it; only addresses and ports are moved to free loopback ones."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    options = options_from_args(parser.parse_args(operator_args(docs)))
    secret = one(docs, "Secret")
    cert_dir = tmp / "webhook-tls"
    cert_dir.mkdir()
    for key in ("tls.crt", "tls.key"):
        (cert_dir / key).write_bytes(base64.b64decode(secret["data"][key]))
    return dataclasses.replace(options, kubeconfig=str(kubeconfig), webhook_cert_dir=str(cert_dir),
                               webhook_addr="127.0.0.1", webhook_port=free_port(), metrics_addr="127.0.0.1",
                               metrics_port=free_port(), liveness=f"http://127.0.0.1:{free_port()}/healthz")
