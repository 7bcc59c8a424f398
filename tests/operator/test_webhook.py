"""AdmissionReview requests against the operator's live webhook (HTTP and self-signed HTTPS)."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import socket
import ssl
import subprocess
import time

import jsonpatch
import pytest
import requests

from kube_helpers import Kube, wait_for
from pod_security import restricted_violations
from test_crd import VALIDATE
from maru_operator import ANNOTATION_INJECTED, ANNOTATION_PLACEMENT, ANNOTATION_SKIPPED
from maru_connector.config import parse_config
from maru_operator.desired import CREDENTIAL_FILE, SOCKET_DIR, TOKEN_FILE
from maru_operator.injection import CONFIG_ENV, SIDECAR_NAME
from maru_operator.webhook import SelfSigningWebhookServer
from maru_tools.index_process import free_port
from maru_tools.kube_emulator import OperatorThread


def pod(cache: str, name: str = "vllm-0", **extra) -> dict:
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"maru.io/cache": cache, "app": "vllm"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai",
                                     "args": ["--model", "/models/llama"]}]}}
    body["spec"]["containers"][0].update(extra)
    return body


MESH_PROXY = {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0", "args": ["proxy", "sidecar"]}


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
                               webhook_port=port, native_sidecars="never")
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
    assert len(meta["annotations"][ANNOTATION_PLACEMENT]) == 16
    names = [c["name"] for c in spec["containers"]]
    assert names == ["vllm", SIDECAR_NAME] and "initContainers" not in spec
    vllm, sidecar = spec["containers"]
    assert vllm["args"][-2:] == ["--kv-transfer-config", f"$({CONFIG_ENV})"]
    assert vllm["env"][0]["valueFrom"]["configMapKeyRef"]["name"] == "shared-maru-config"
    assert "resources" not in vllm and "securityContext" not in vllm  # the vLLM container needs nothing
    # DAX comes from the device plugin as a resource: no hostPath anywhere in the pod.
    assert not [v for v in spec["volumes"] if "hostPath" in v]
    limits, requests = sidecar["resources"]["limits"], sidecar["resources"]["requests"]
    assert limits == {"cpu": "100m", "memory": "128Mi", "squat.ai/dax0.0": "1"} == requests  # Guaranteed stays so
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"] == {"drop": ["ALL"]} and security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert 65532 in spec["securityContext"]["supplementalGroups"]  # vLLM may connect to the 0660 socket
    # What the webhook adds never lowers the namespace's Pod Security level below restricted.
    assert restricted_violations(spec, containers=[SIDECAR_NAME]) == []
    cmd = sidecar["command"]
    assert cmd[:4] == ["marucache", "sidecar", "--pool", "/dev/dax0.0"]
    assert cmd[cmd.index("--cache") + 1] == "shared" and cmd[cmd.index("--socket") + 1] == "/var/run/maru/sidecar.sock"
    assert cmd[cmd.index("--socket-group") + 1] == "65532"
    assert {v["name"] for v in spec["volumes"]} == {"maru-socket", "maru-token", "maru-tmp"}
    assert {"emptyDir": {}, "name": "maru-socket"} in spec["volumes"]
    token = next(v for v in spec["volumes"] if v["name"] == "maru-token")
    assert token["secret"]["defaultMode"] == 0o444  # no fsGroup here: the sidecar (65532) reads it as "other"
    assert "fsGroup" not in spec["securityContext"]
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchFields"][0]["values"] == ["rack-a-1", "rack-a-2"]
    again, same = review(webhook, injected)
    assert "patch" not in again and same == injected
    _validate(tmp_path, injected)


def _validate(tmp_path, obj):
    manifest = tmp_path / "pod.json"
    manifest.write_text(json.dumps(obj))
    run = subprocess.run(VALIDATE + [str(manifest)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_vllm_container_is_picked_not_the_first(webhook):
    meshed = pod("shared")
    meshed["spec"]["containers"].insert(0, dict(MESH_PROXY))
    _, patched = review(webhook, meshed)
    proxy, vllm = patched["spec"]["containers"][:2]
    assert proxy == MESH_PROXY, "the mesh proxy listed first must not get vLLM's flags"
    assert vllm["args"][-2:] == ["--kv-transfer-config", f"$({CONFIG_ENV})"]
    named = pod("shared", name="named", image="registry.example.com/inference:7")
    named["spec"]["containers"][0]["name"] = "server"
    named["spec"]["containers"].append({"name": "exporter", "image": "prom/node-exporter"})
    named["metadata"]["annotations"] = {"maru.io/container": "server"}
    _, patched = review(webhook, named)
    assert patched["spec"]["containers"][0]["args"][-1] == f"$({CONFIG_ENV})"
    assert "args" not in patched["spec"]["containers"][1]


@pytest.mark.parametrize("change, why", [
    (lambda p: p["spec"]["containers"].append({"name": "vllm-2", "image": "vllm/vllm-openai"}),
     "several containers look like vLLM"),
    (lambda p: p["spec"]["containers"].__setitem__(0, {"name": "server", "image": "example.com/llm:1"}) or
     p["spec"]["containers"].append({"name": "exporter", "image": "prom/node-exporter"}),
     "no container looks like vLLM"),
    (lambda p: p["metadata"].__setitem__("annotations", {"maru.io/container": "missing"}),
     "container 'missing' named by maru.io/container is not in the pod"),
    (lambda p: p["spec"]["containers"][0].update(command=["sh", "-c"], args=["exec vllm serve /models/llama"]),
     'add --kv-transfer-config "$MARU_KV_TRANSFER_CONFIG" to the vLLM command in the script'),
], ids=["two-vllm", "no-vllm", "named-missing", "shell-script"])
def test_what_cannot_be_injected_is_refused_with_an_annotation_and_an_event(webhook, kube, change, why):
    refused = pod("shared", name=f"refused-{abs(hash(why)) % 10000}")
    change(refused)
    _, patched = review(webhook, refused)
    assert why in patched["metadata"]["annotations"][ANNOTATION_SKIPPED]
    assert patched["spec"] == refused["spec"], "a refused pod is admitted unchanged"
    event = wait_for(lambda: [e for e in kube.events("InjectionSkipped")
                              if e["involvedObject"]["name"] == refused["metadata"]["name"]], what="the Event")[0]
    assert event["type"] == "Warning" and why in event["message"]
    assert event["involvedObject"]["kind"] == "Pod"


def test_a_shell_script_that_passes_the_variable_gets_it_and_no_appended_args(webhook):
    script = 'exec python -m vllm.entrypoints.openai.api_server --model m --kv-transfer-config "$MARU_KV_TRANSFER_CONFIG"'
    body = pod("shared", command=["/bin/sh", "-c", script])
    del body["spec"]["containers"][0]["args"]
    _, patched = review(webhook, body)
    vllm = patched["spec"]["containers"][0]
    assert vllm["command"] == ["/bin/sh", "-c", script] and "args" not in vllm
    assert vllm["env"][0]["name"] == CONFIG_ENV
    assert [c["name"] for c in patched["spec"]["containers"]] == ["vllm", SIDECAR_NAME]


def test_an_unnamed_controller_pod_gets_its_event_on_the_owner(webhook, kube):
    body = pod("shared")
    del body["metadata"]["name"]
    body["metadata"]["generateName"] = "llama-7d9f8c6b5-"
    body["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llama-7d9f8c6b5",
                                            "uid": "rs-uid", "controller": True}]
    body["spec"]["containers"].append({"name": "vllm-b", "image": "vllm/vllm-openai"})
    review(webhook, body)
    event = wait_for(lambda: [e for e in kube.events("InjectionSkipped")
                              if e["involvedObject"]["name"] == "llama-7d9f8c6b5"], what="the Event")[0]
    assert event["involvedObject"]["kind"] == "ReplicaSet"


@pytest.mark.parametrize("minor, native", [("30", True), ("28", False)])
def test_native_sidecar_where_the_cluster_supports_it(kube, cluster, options, tmp_path, minor, native):
    cluster.call(lambda: setattr(cluster.emulator, "server_version",
                                 {"major": "1", "minor": minor, "gitVersion": f"v1.{minor}.2"}))
    port = free_port()
    opts = dataclasses.replace(options, webhook=True, webhook_insecure=True, webhook_addr="127.0.0.1",
                               webhook_port=port, native_sidecars="auto")
    with OperatorThread(opts):
        kube.apply_cache("native", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
        wait_for(lambda: (kube.cache("native").get("status") or {}).get("allocations"), what="allocation")
        url = f"http://127.0.0.1:{port}/inject"
        body = pod("native")
        body["spec"]["initContainers"] = [{"name": "fetch-model", "image": "busybox", "command": ["true"]}]
        patched = wait_for(lambda: (r := review(url, body)[1]) and ANNOTATION_INJECTED in r["metadata"].get(
            "annotations", {}) and r, what="injected")
    spec = patched["spec"]
    if native:
        assert [c["name"] for c in spec["initContainers"]] == [SIDECAR_NAME, "fetch-model"]
        assert spec["initContainers"][0]["restartPolicy"] == "Always"
        assert [c["name"] for c in spec["containers"]] == ["vllm"]
    else:
        assert [c["name"] for c in spec["initContainers"]] == ["fetch-model"]
        assert [c["name"] for c in spec["containers"]] == ["vllm", SIDECAR_NAME]
    _validate(tmp_path, patched)


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


def _token_mounts(patched: dict, container: dict) -> list[dict]:
    """The mounts of `container` that show the cache's token Secret, whatever the volume is called."""
    secret_volumes = {v["name"] for v in patched["spec"]["volumes"]
                      if (v.get("secret") or {}).get("secretName") == "shared-maru-token"}
    return [m for m in container.get("volumeMounts") or () if m["name"] in secret_volumes]


def _mounting(container: dict, path: str) -> str:
    """The volume `container` sees `path` on."""
    return max((m for m in container.get("volumeMounts") or () if path.startswith(m["mountPath"].rstrip("/") + "/")),
               key=lambda m: len(m["mountPath"]))["name"]


def test_the_vllm_container_reads_its_pods_credential_and_never_sees_the_cache_token(webhook, kube):
    """The sidecar mints the pod's credential from the cache token and writes it into the volume it
    shares with vLLM, where vLLM's config looks for its token; the vLLM container does not mount the
    token, so it cannot mint another pod's credential."""
    script = 'exec vllm serve /models/llama --kv-transfer-config "$MARU_KV_TRANSFER_CONFIG"'
    for body in (pod("shared", name="plain"), pod("shared", name="script", command=["sh", "-c", script])):
        _, patched = review(webhook, body)
        vllm, sidecar = patched["spec"]["containers"]
        assert _token_mounts(patched, vllm) == [], "the vLLM container must not see the cache token"
        assert _token_mounts(patched, sidecar) and sidecar["command"][sidecar["command"].index("--token-file") + 1] \
            == TOKEN_FILE, "the sidecar mints the credential from the cache token"
        command = sidecar["command"]
        assert command[command.index("--credential-file") + 1] == CREDENTIAL_FILE
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in sidecar["env"]}
        assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
        # vLLM's config names the file the sidecar writes, on the same volume in both containers.
        key = next(e for e in vllm["env"] if e["name"] == CONFIG_ENV)["valueFrom"]["configMapKeyRef"]
        config = wait_for(lambda: kube.objects("v1/configmaps").get(("default", key["name"])), what="config map")
        extra = json.loads(config["data"][key["key"]])["kv_connector_extra_config"]
        assert parse_config(extra).maru_token_file == CREDENTIAL_FILE
        assert _mounting(vllm, CREDENTIAL_FILE) == _mounting(sidecar, CREDENTIAL_FILE) == "maru-socket"
        assert CREDENTIAL_FILE.startswith(SOCKET_DIR + "/")


def test_the_injected_sidecar_command_starts_a_sidecar_that_writes_the_pods_credential(webhook, tmp_path):
    """The sidecar's own parser and checks take the command the webhook injects, with the pod's
    name and namespace from the downward API, and name the pod and the file vLLM reads."""
    import argparse

    from maru_sidecar.cli import add_arguments
    from maru_sidecar.config import SidecarConfig

    _, patched = review(webhook, pod("shared", name="vllm-7"))
    sidecar = patched["spec"]["containers"][1]
    socket_dir, token_dir = tmp_path / "socket", tmp_path / "token"
    socket_dir.mkdir()
    token_dir.mkdir()
    (token_dir / "token").write_text("t" * 32)
    (token_dir / "token").chmod(0o600)
    here = [str(word).replace(TOKEN_FILE, str(token_dir / "token")).replace(SOCKET_DIR + "/", f"{socket_dir}/")
            for word in sidecar["command"][2:]]  # after `marucache sidecar`
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    downward = {"POD_NAME": "vllm-7", "POD_NAMESPACE": patched["metadata"]["namespace"]}
    config = SidecarConfig.from_args(parser.parse_args(here), environ=downward)
    assert config.pod_identity == "default/vllm-7"
    assert config.credential_file == socket_dir / CREDENTIAL_FILE.removeprefix(SOCKET_DIR + "/")


def test_a_pod_with_its_own_config_keeps_the_token_mounted(webhook):
    """A user's own --kv-transfer-config may name the cache token's file: that vLLM container keeps
    the token, read-only, where it always was; its sidecar writes the pod's credential all the same."""
    user = pod("shared", args=["--model", "m", "--kv-transfer-config",
                               json.dumps({"kv_connector": "MaruKVConnector",
                                           "kv_connector_extra_config": {"maru_token_file": TOKEN_FILE}})])
    _, patched = review(webhook, user)
    vllm, sidecar = patched["spec"]["containers"]
    assert _token_mounts(patched, vllm) == [{"name": "maru-token", "mountPath": "/var/run/maru-token",
                                             "readOnly": True}]
    assert TOKEN_FILE.startswith("/var/run/maru-token/")
    assert sidecar["command"][sidecar["command"].index("--credential-file") + 1] == CREDENTIAL_FILE
    assert _mounting(vllm, CREDENTIAL_FILE) == "maru-socket"  # a config naming the credential works too


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


def test_a_renewed_certificate_is_served_without_closing_the_listener(kube: Kube, options, tmp_path):
    """The mounted Secret is replaced (as cert-manager renews it and the kubelet
    swaps the files): later handshakes present the new certificate, reviews
    keep being answered, and no connection is refused meanwhile (the webhook
    fails open: a refused call would start a pod without its sidecar)."""
    port = free_port()
    cert_dir = tmp_path / "tls"
    cert_dir.mkdir()

    def install(host: str) -> str:
        cert, key = SelfSigningWebhookServer.build_certificate(["127.0.0.1", host])
        staged = tmp_path / "staged"
        staged.mkdir(exist_ok=True)
        (staged / "tls.key").write_bytes(key)
        (staged / "tls.crt").write_bytes(cert)
        for name in ("tls.key", "tls.crt"):
            (staged / name).replace(cert_dir / name)
        return cert.decode()

    first = install("first.example")
    opts = dataclasses.replace(options, webhook=True, webhook_addr="127.0.0.1", webhook_port=port,
                               webhook_cert_dir=str(cert_dir), webhook_cert_check_seconds=0.2)
    with OperatorThread(opts):
        assert _same_cert(wait_for(lambda: _server_cert(port), what="TLS listener"), first)
        refused = []
        second = install("second.example")
        deadline = time.monotonic() + 10
        while not _same_cert(_server_cert(port) or "", second):
            with socket.socket() as probe:  # the listener stays open throughout
                if probe.connect_ex(("127.0.0.1", port)) != 0:
                    refused.append(time.monotonic())
            assert time.monotonic() < deadline, "the renewed certificate was not served within 10 s"
            time.sleep(0.02)
        assert not refused
        ca = tmp_path / "second.pem"
        ca.write_text(second)
        answer, patched = review(f"https://127.0.0.1:{port}/inject", pod("missing"), verify=str(ca))
        assert ANNOTATION_SKIPPED in patched["metadata"]["annotations"]


def _same_cert(served: str, pem: str) -> bool:
    """Whether two PEM texts hold the same certificate (the server's comes re-encoded)."""
    return bool(served) and ssl.PEM_cert_to_DER_cert(served) == ssl.PEM_cert_to_DER_cert(pem)


def _server_cert(port: int) -> str | None:
    try:
        return ssl.get_server_certificate(("127.0.0.1", port), timeout=2)
    except OSError:
        return None


def test_out_of_cluster_install_creates_the_webhook_configuration(kube, cluster, options, tmp_path):
    """docs/operator.md's out-of-cluster command: with --webhook-manage the operator registers its own
    MutatingWebhookConfiguration, pointing at --webhook-host, trusting its self-signed certificate."""
    port = free_port()
    opts = dataclasses.replace(options, webhook=True, webhook_addr="127.0.0.1", webhook_port=port,
                               webhook_host="127.0.0.1", webhook_manage=True)
    with OperatorThread(opts):
        config = wait_for(lambda: (c := kube.objects("admissionregistration.k8s.io/v1/mutatingwebhookconfigurations")
                                   .get((None, "marucache.maru.io"))) and c.get("webhooks") and c,
                          what="the webhook configuration")  # kopf creates it, then patches the webhooks in
        (hook,) = [h for h in config["webhooks"] if "inject" in h["name"]]
        assert hook["clientConfig"]["url"].startswith(f"https://127.0.0.1:{port}/inject")
        ca = tmp_path / "ca.pem"
        ca.write_bytes(base64.b64decode(hook["clientConfig"]["caBundle"]))
        answer, patched = review(hook["clientConfig"]["url"], pod("missing"), verify=str(ca))
        assert ANNOTATION_SKIPPED in patched["metadata"]["annotations"]  # the API server's call works
        assert hook["objectSelector"]["matchExpressions"][0]["key"] == "maru.io/cache"
    calls = cluster.call(lambda: {(r.method.value, r.url.path.rsplit("/", 1)[-1] if "marucache.maru.io" in r.url.path
                                   else "collection") for r in cluster.emulator
                                  if "mutatingwebhookconfigurations" in r.url.path})
    # What docs/operator.md tells an out-of-cluster user to grant besides the chart's ClusterRole.
    assert calls <= {("POST", "collection"), ("PATCH", "marucache.maru.io")}, calls  # create and patch
