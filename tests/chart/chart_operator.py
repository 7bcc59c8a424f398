"""The real operator started from the chart's own Deployment args and TLS Secret against kmock,
with every API call it makes recorded (`chart_operator`, used by tests/chart/conftest.py)."""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import requests
import urllib3
from helm_tools import find, one, operator_args

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


@contextlib.contextmanager
def chart_operator(docs: list[dict[str, Any]], tmp: pathlib.Path) -> Iterator[OperatorRun]:
    """The operator of the rendered chart `docs`, running against a fresh kmock cluster that holds
    the chart's CRD and the `NODES`."""
    hook = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    ca_file = tmp / "ca.crt"
    ca_file.write_bytes(base64.b64decode(hook["clientConfig"]["caBundle"]))
    with KmockCluster() as cluster:
        options = chart_options(docs, tmp, cluster.write_kubeconfig(tmp / "kubeconfig"))
        run = OperatorRun(cluster, OperatorThread(options), docs, f"https://127.0.0.1:{options.webhook_port}/inject",
                          options.webhook_host, ca_file, options.metrics_port)
        # The CRD the chart installs, so kopf's discovery finds the resource it watches.
        run.kube("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                 find(docs, "CustomResourceDefinition")[0])
        for name, (labels, annotations) in NODES.items():
            run.kube("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                               "metadata": {"name": name, "labels": labels,
                                                            "annotations": annotations}})
        with run.operator:
            yield run


def admission(run: OperatorRun, pod: dict) -> dict:
    """An AdmissionReview over HTTPS, trusting only the chart's caBundle and checking the Service's name."""
    pool = urllib3.HTTPSConnectionPool("127.0.0.1", int(run.webhook_url.split(":")[2].split("/")[0]),
                                       cert_reqs="CERT_REQUIRED", ca_certs=str(run.ca_file),
                                       server_hostname=run.webhook_host, assert_hostname=run.webhook_host)
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "chart-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                          "resource": {"group": "", "version": "v1", "resource": "pods"},
                          "namespace": pod["metadata"]["namespace"], "operation": "CREATE", "object": pod,
                          "userInfo": {"username": "system:serviceaccount:default:deployer"}, "dryRun": False}}
    path = one(run.docs, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["service"]["path"]
    resp = pool.request("POST", path, body=json.dumps(review), headers={"Content-Type": "application/json"})
    assert resp.status == 200, resp.data[:500]
    return json.loads(resp.data)["response"]


def cache_condition(run: OperatorRun, name: str, kind: str, namespace: str = "default") -> dict | None:
    body = run.kube("GET", f"{CACHES.format(ns=namespace)}/{name}") or {}
    return next((c for c in (body.get("status") or {}).get("conditions") or () if c["type"] == kind), None)


def a_cache_lifetime(run: OperatorRun, ns: str = "default") -> None:
    """In namespace `ns`: create (its first status write conflicting), become Ready, change the spec,
    inject a pod, refuse a bad spec, delete."""
    caches = CACHES.format(ns=ns)
    # A status write that conflicts is re-read (GET) and written again; one cache alone rarely races,
    # so the API server answers the first status write with 409 as it would under contention.
    run.cluster.call(lambda: run.cluster.emulator.fail("PATCH", "/marucaches/life/status", 409))
    run.kube("POST", caches, {"apiVersion": "maru.io/v1alpha1", "kind": "MaruCache",
                              "metadata": {"name": "life", "namespace": ns},
                              "spec": {"pool": {"deviceClass": "dax", "size": "2Gi"}}})
    wait_for(lambda: run.kube("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/life-maru-index"),
             what="index Deployment")
    run.kube("PATCH", f"/apis/apps/v1/namespaces/{ns}/deployments/life-maru-index/status",
             {"status": {"availableReplicas": 1, "readyReplicas": 1, "replicas": 1}}, "application/merge-patch+json")
    wait_for(lambda: (cache_condition(run, "life", "Ready", ns) or {}).get("status") == "True", what="Ready")
    # A new index port changes every child: config map, Deployment, Service and NetworkPolicy are patched.
    run.kube("PATCH", f"{caches}/life", {"spec": {"storage": {"chunkTokens": 128}, "index": {"port": 7171}}},
             "application/merge-patch+json")
    wait_for(lambda: 7171 in [p["port"] for p in run.kube(
        "GET", f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/life-maru-index")["spec"]["ingress"][0][
        "ports"]], what="network policy updated")
    def chunk_tokens() -> int:
        data = run.kube("GET", f"/api/v1/namespaces/{ns}/configmaps/life-maru-config")["data"]
        pods_config = json.loads(data["kv-transfer-config-credential.json"])  # what injected pods read
        return pods_config["kv_connector_extra_config"]["maru_kv_chunk_tokens"]
    wait_for(lambda: chunk_tokens() == 128, what="config map updated")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "vllm-0", "namespace": ns, "labels": {"maru.io/cache": "life"}},
           "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}
    answer = wait_for(lambda: (a := admission(run, pod)).get("patch") and "maru-sidecar" in base64.b64decode(
        a["patch"]).decode() and a, what="sidecar injected")
    assert answer["allowed"] is True and answer["uid"] == "chart-1"
    run.kube("POST", caches, {"apiVersion": "maru.io/v1alpha1", "kind": "MaruCache",
                              "metadata": {"name": "bad", "namespace": ns},
                              "spec": {"pool": {"deviceClass": "pmem", "size": "1Gi"}}})
    wait_for(lambda: (cache_condition(run, "bad", "ConfigValid", ns) or {}).get("status") == "False", what="invalid")
    for name in ("life", "bad"):
        run.kube("DELETE", f"{caches}/{name}")
    wait_for(lambda: run.kube("GET", f"{caches}/life") is None and run.kube("GET", f"{caches}/bad") is None,
             what="finalizers removed")
