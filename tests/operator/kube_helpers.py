"""Helpers shared by the operator tests: the CRD, HTTP access to the cluster like kubectl, waiting."""

from __future__ import annotations

import copy
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import requests
import yaml

from maru_tools.kube_emulator import KmockCluster, iter_objects
ROOT = pathlib.Path(__file__).parents[2]
CRD_PATH = ROOT / "crds" / "marucache.yaml"
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))
CACHES = "/apis/maru.io/v1alpha1/namespaces/{ns}/marucaches"


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it (objects only, recursively)."""
    if not isinstance(obj, dict) or schema.get("type") != "object":
        return obj
    out = dict(obj)
    for key, sub in (schema.get("properties") or {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


class Kube:
    """A kubectl-like HTTP client of the mock API server."""

    def __init__(self, cluster: KmockCluster) -> None:
        self.cluster = cluster
        self.http = requests.Session()

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        resp = self.http.request(method, self.cluster.url + path, data=None if body is None else json.dumps(body),
                                 headers={"Content-Type": content_type}, timeout=30)
        if resp.status_code == 404:
            return None
        assert resp.status_code < 400, f"{method} {path}: {resp.status_code} {resp.text[:500]}"
        return resp.json()

    def apply_cache(self, name: str, spec: dict[str, Any], ns: str = "default") -> dict[str, Any]:
        body = {"apiVersion": "maru.io/v1alpha1", "kind": "MaruCache",
                "metadata": {"name": name, "namespace": ns}, "spec": spec}
        return self.request("POST", CACHES.format(ns=ns), body)

    def cache(self, name: str, ns: str = "default") -> dict[str, Any] | None:
        return self.request("GET", f"{CACHES.format(ns=ns)}/{name}")

    def patch_cache(self, name: str, spec: dict[str, Any], ns: str = "default") -> Any:
        return self.request("PATCH", f"{CACHES.format(ns=ns)}/{name}", {"spec": spec},
                            "application/merge-patch+json")

    def delete_cache(self, name: str, ns: str = "default") -> Any:
        return self.request("DELETE", f"{CACHES.format(ns=ns)}/{name}")

    def add_node(self, name: str, labels: dict[str, str], annotations: dict[str, str]) -> None:
        self.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                               "metadata": {"name": name, "labels": labels,
                                                            "annotations": annotations}})

    def objects(self, resource: str) -> dict[tuple[str | None, str], dict[str, Any]]:
        return {(ns, name): body for ns, name, body in iter_objects(self.cluster, resource)}

    def ledger(self) -> list[dict[str, Any]]:
        cm = self.request("GET", "/api/v1/namespaces/maru-system/configmaps/marucache-ledger")
        return json.loads(cm["data"]["ledger.json"])["claims"] if cm else []

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.objects("v1/events").values() if reason is None or e.get("reason") == reason]

    def make_index_available(self, name: str, ns: str = "default") -> None:
        """Play the Deployment controller: report one available replica."""
        self.request("PATCH", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}-maru-index/status",
                     {"status": {"availableReplicas": 1, "readyReplicas": 1, "replicas": 1}},
                     "application/merge-patch+json")


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def condition(body: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for cond in ((body or {}).get("status") or {}).get("conditions") or ():
        if cond["type"] == kind:
            return cond
    return None


DAX_NODES = {
    "rack-a-1": ({"maru.io/cxl": "true", "rack": "a"},
                 {"maru.io/dax-devices": json.dumps([{"path": "/dev/dax0.0", "size": "16Gi", "uuid": "cxl-a"}])}),
    "rack-a-2": ({"maru.io/cxl": "true", "rack": "a"},
                 {"maru.io/dax-devices": json.dumps([{"path": "/dev/dax0.0", "size": 17179869184, "uuid": "cxl-a"}])}),
    "shm-1": ({"maru.io/shm": "true"}, {"maru.io/shm-size": "8Gi"}),
}
