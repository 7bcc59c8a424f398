"""AdmissionReview requests against the operator's live webhook (HTTP and self-signed HTTPS)."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import socket
import ssl
import subprocess

import jsonpatch
import pytest
import requests

from kube_helpers import Kube, wait_for
from test_crd import VALIDATE
from maru_operator import ANNOTATION_INJECTED, ANNOTATION_SKIPPED
from maru_operator.injection import CONFIG_ENV, SIDECAR_NAME
from maru_operator.testing import OperatorThread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod(cache: str, name: str = "vllm-0", **extra) -> dict:
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"maru.io/cache": cache, "app": "vllm"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai",
                                     "args": ["--model", "/models/llama"]}]}}
    body["spec"]["containers"][0].update(extra)
    return body


def review(url: str, obj: dict, verify=None) -> tuple[dict, dict]:
    """Send one AdmissionReview; return the response and the pod after its JSON patch."""
    request = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
               "request": {"uid": "req-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                           "resource": {"group": "", "version": "v1", "resource": "pods"},
                           "namespace": "default", "operation": "CREATE", "object": obj,
                           "userInfo": {"username": "system:serviceaccount:default:deployer"}, "dryRun": False}}
    resp = requests.post(url, json=request, timeout=30, verify=verify if verify is not None else True)
    assert resp.status_code == 200, resp.text
    answer = resp.json()["response"]
    assert answer["uid"] == "req-1" and answer["allowed"] is True
    patched = copy.deepcopy(obj)
    if answer.get("patch"):
        assert answer["patchType"] == "JSONPatch"
        patched = jsonpatch.apply_patch(patched, json.loads(base64.b64decode(answer["patch"])))
    return answer, patched


@pytest.fixture
def webhook(kube: Kube, options):
    port = free_port()
    opts = dataclasses.replace(options, webhook=True, webhook_insecure=True, webhook_addr="127.0.0.1",
                               webhook_port=port)
    with OperatorThread(opts):
        kube.apply_cache("shared", {"pool": {"deviceClass": "dax", "size": "4Gi"},
                                    "podSelector": {"matchLabels": {"app": "vllm"}}})
        wait_for(lambda: (kube.cache("shared").get("status") or {}).get("allocations"), what="allocation")
        url = f"http://127.0.0.1:{port}/inject"
        # The webhook answers from the operator's watch of the caches, which may trail the API server.
        wait_for(lambda: len(review(url, pod("shared"))[1]["spec"]["containers"]) == 2, what="webhook sees it")
        yield url


def test_inject_then_second_pass_is_a_no_op(webhook, tmp_path):
    answer, injected = review(webhook, pod("shared"))
    meta, spec = injected["metadata"], injected["spec"]
    assert meta["annotations"][ANNOTATION_INJECTED] == "shared"
    names = [c["name"] for c in spec["containers"]]
    assert names == ["vllm", SIDECAR_NAME]
    vllm, sidecar = spec["containers"]
    assert vllm["args"][-2:] == ["--kv-transfer-config", f"$({CONFIG_ENV})"]
    assert vllm["env"][0]["valueFrom"]["configMapKeyRef"]["name"] == "shared-maru-config"
    assert "maru-pool" not in [m["name"] for m in vllm["volumeMounts"]]  # the device only in the sidecar
    assert "maru-pool" in [m["name"] for m in sidecar["volumeMounts"]]
    cmd = sidecar["command"]
    assert cmd[:4] == ["marucache", "sidecar", "--pool", "/dev/dax0.0"]
    assert cmd[cmd.index("--cache") + 1] == "shared" and cmd[cmd.index("--socket") + 1] == "/var/run/maru/sidecar.sock"
    assert {v["name"] for v in spec["volumes"]} == {"maru-socket", "maru-pool", "maru-token"}
    assert {"emptyDir": {}, "name": "maru-socket"} in spec["volumes"]
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchFields"][0]["values"] == ["rack-a-1", "rack-a-2"]
    again, same = review(webhook, injected)
    assert "patch" not in again and same == injected
    manifest = tmp_path / "pod.json"
    manifest.write_text(json.dumps(injected))
    run = subprocess.run(VALIDATE + [str(manifest)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_skips_with_a_reason_and_admits(webhook):
    answer, patched = review(webhook, pod("nonexistent"))
    assert patched["metadata"]["annotations"][ANNOTATION_SKIPPED] == \
        "MaruCache nonexistent not found in namespace default"
    assert [c["name"] for c in patched["spec"]["containers"]] == ["vllm"]
    other = pod("shared")
    other["metadata"]["labels"]["app"] = "batch"
    _, patched = review(webhook, other)
    assert "podSelector" in patched["metadata"]["annotations"][ANNOTATION_SKIPPED]
    assert len(patched["spec"]["containers"]) == 1


def test_user_config_is_left_alone(webhook):
    user = pod("shared", args=["--model", "m", "--kv-transfer-config", '{"kv_connector":"Mine"}'])
    _, patched = review(webhook, user)
    vllm = patched["spec"]["containers"][0]
    assert vllm["args"] == ["--model", "m", "--kv-transfer-config", '{"kv_connector":"Mine"}']
    assert not any(e["name"] == CONFIG_ENV for e in vllm.get("env", []))
    assert [c["name"] for c in patched["spec"]["containers"]] == ["vllm", SIDECAR_NAME]
    assert patched["metadata"]["annotations"]["maru.io/kv-transfer-config"].startswith("user-provided")


def test_pods_without_the_label_are_not_touched(webhook):
    plain = pod("shared")
    del plain["metadata"]["labels"]["maru.io/cache"]
    answer, patched = review(webhook, plain)
    assert "patch" not in answer and patched == plain


def test_https_with_a_self_signed_certificate(kube: Kube, options, tmp_path):
    port = free_port()
    opts = dataclasses.replace(options, webhook=True, webhook_addr="127.0.0.1", webhook_port=port)
    with OperatorThread(opts):
        pem = wait_for(lambda: _server_cert(port), what="TLS listener")
        ca = tmp_path / "ca.pem"
        ca.write_text(pem)
        answer, patched = review(f"https://127.0.0.1:{port}/inject", pod("missing"), verify=str(ca))
        assert ANNOTATION_SKIPPED in patched["metadata"]["annotations"]
        with pytest.raises(requests.exceptions.SSLError):
            requests.post(f"https://127.0.0.1:{port}/inject", json={}, timeout=10)  # not trusted by default


def _server_cert(port: int) -> str | None:
    try:
        return ssl.get_server_certificate(("127.0.0.1", port), timeout=2)
    except OSError:
        return None
