"""docs/install.md, run: every command of the page is either exercised here (the real helm, the operator
started from the chart's own arguments against kmock, its real webhook, pip, hadolint, make) or named in
NOT_RUN with the reason; a command that is neither fails the test."""

from __future__ import annotations

import base64
import copy
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from typing import Any

import jsonpatch
import jsonschema
import requests
import urllib3
import yaml
from chart_operator import TEST_AGENT, OperatorRun, chart_options, wait_for
from helm_tools import CHART, KUBERNETES_VALIDATE, ROOT, helm, one

from maru_tools.kube_emulator import KmockCluster, OperatorThread

sys.path.insert(0, str(ROOT / "tests" / "operator"))
from kube_helpers import apply_defaults  # noqa: E402
from pod_security import baseline_violations, restricted_violations  # noqa: E402

DOC = ROOT / "docs" / "install.md"
HADOLINT = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("hadolint")
# Commands that need a real cluster, registry or container engine, and what stands in for them.
NOT_RUN = {
    "docker push": "needs a registry; the tag is the one `make image` builds (checked)",
    "kubectl rollout": "needs a Deployment controller; the stale-pod report naming `rollout restart` is "
                       "tested in tests/operator/test_upkeep.py",
    "kubectl logs": "needs a running container",
    "kubectl port-forward": "needs a running pod",
    "curl": "reads what the port-forward exposes; the sidecar's metrics are tested in tests/sidecar",
    "kubectl get pods": "lists pods a real controller made; the injection itself is checked here",
    "kubectl describe": "prints the conditions and Events checked here",
}
PACKAGE_FILES = ("pyproject.toml", "README.md", "core", "connector", "sidecar", "operator", "tools")


def fenced(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


def commands() -> list[tuple[list[str], str]]:
    """(argv, heredoc text) of every command of the page's `sh` blocks, in order."""
    found = []
    for block in fenced("sh"):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            i += 1
            while line.endswith("\\"):
                line = line[:-1] + " " + lines[i].strip()
                i += 1
            if not line or line.startswith("#"):
                continue
            stdin = ""
            heredoc = re.search(r"<<'?(\w+)'?\s*$", line)
            if heredoc:
                end = lines.index(heredoc.group(1), i)
                stdin, i = "\n".join(lines[i:end]) + "\n", end + 1
                line = line[:heredoc.start()].strip()
            found.append((shlex.split(line), stdin))
    return found


def flag(argv: list[str], name: str) -> str:
    for i, word in enumerate(argv):
        if word == name:
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} missing in {argv}")


def validate_strict(tmp: pathlib.Path, docs: list[dict[str, Any]], name: str) -> None:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    run = subprocess.run([KUBERNETES_VALIDATE, "--strict", "--quiet", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def is_guaranteed(pod_spec: dict[str, Any]) -> bool:
    """Every container, init containers included, has cpu and memory requests equal to its limits."""
    for container in list(pod_spec.get("initContainers") or []) + list(pod_spec["containers"]):
        res = container.get("resources") or {}
        for name in ("cpu", "memory"):
            if name not in (res.get("limits") or {}) or (res.get("requests") or {}).get(name) != res["limits"][name]:
                return False
    return True


class Journey:
    """What the page's commands build up: the image tag, the rendered chart, kmock and the operator."""

    def __init__(self, tmp: pathlib.Path, cluster: KmockCluster):
        self.tmp, self.cluster = tmp, cluster
        self.image_tag = ""
        self.docs: list[dict[str, Any]] = []
        self.run: OperatorRun | None = None
        self.wheels: list[str] = []
        self.namespaces: dict[str, dict[str, str]] = {}

    def level(self, namespace: str) -> str:
        return self.namespaces[namespace].get("pod-security.kubernetes.io/enforce", "privileged")

    def kube(self, method: str, path: str, body: Any = None, merge: bool = False) -> Any:
        """kubectl's request to the cluster (the test's own User-Agent keeps it apart from the operator's)."""
        resp = requests.request(method, self.cluster.url + path, timeout=30,
                                data=None if body is None else json.dumps(body),
                                headers={"Content-Type": "application/merge-patch+json" if merge else
                                         "application/json", "User-Agent": TEST_AGENT})
        if resp.status_code == 404:
            return None
        assert resp.status_code < 400, f"{method} {path}: {resp.status_code} {resp.text[:500]}"
        return resp.json()

    # -- the admin ------------------------------------------------------------------------------

    def make_image(self, argv: list[str]) -> None:
        run = subprocess.run(["make", "-s", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True, check=True)
        self.image_tag = shlex.split(run.stdout.strip())[-2]
        assert self.image_tag == argv[2].removeprefix("IMAGE=")

    def docker_push(self, argv: list[str]) -> None:
        assert argv[2] == self.image_tag or argv[2].startswith("registry.example.com/ml/vllm-marucache:")

    def helm_install(self, argv: list[str]) -> None:
        assert argv[:2] == ["helm", "install"] and argv[3] == "charts/marucache"
        self.docs = [d for d in yaml.safe_load_all(helm("template", argv[2], str(CHART), *argv[4:])) if d]
        validate_strict(self.tmp, [d for d in self.docs if not d["apiVersion"].startswith("monitoring.")], "chart")
        operator = one(self.docs, "Deployment")
        assert operator["metadata"]["namespace"] == flag(argv, "--namespace")
        assert operator["spec"]["template"]["spec"]["containers"][0]["image"] == self.image_tag, \
            "the chart must run the image `make image` built"
        plugin = one(self.docs, "DaemonSet")["spec"]["template"]["spec"]
        assert plugin["nodeSelector"] == {"maru.io/cxl": "true"}
        assert baseline_violations(plugin) and self.level(flag(argv, "--namespace")) == "privileged", \
            "the device plugin is privileged: its namespace must enforce privileged"
        assert restricted_violations(operator["spec"]["template"]["spec"]) == []
        devices = [json.loads(a.split("=", 1)[1]) for a in plugin["containers"][0]["args"] if a.startswith("--device=")]
        # the page's node has /dev/dax0.0: it must be one of the resources, alone in its group
        assert {"name": "dax0.0", "groups": [{"count": 64, "paths": [{"path": "/dev/dax0.0"}]}]} in devices
        hook = one(self.docs, "MutatingWebhookConfiguration")["webhooks"][0]
        ca_file = self.tmp / "ca.crt"
        ca_file.write_bytes(base64.b64decode(hook["clientConfig"]["caBundle"]))
        options = chart_options(self.docs, self.tmp, self.cluster.write_kubeconfig(self.tmp / "kubeconfig"))
        self.run = OperatorRun(self.cluster, OperatorThread(options), self.docs,
                               f"https://127.0.0.1:{options.webhook_port}/inject", options.webhook_host, ca_file,
                               options.metrics_port)
        self.kube("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                  one(self.docs, "CustomResourceDefinition"))
        self.run.operator.__enter__()

    def kubectl_object(self, argv: list[str]) -> None:
        """`kubectl create namespace N`, `kubectl label|annotate node|namespace N K=V ...`.

        kmock cannot store namespaces (it answers 500): their labels are kept here, and the Pod
        Security level each one enforces is checked against the pods that land in it."""
        verb, kind, name, *pairs = argv[1:]
        assert kind in ("node", "namespace"), argv
        if kind == "namespace":
            labels = self.namespaces.setdefault(name, {})
            assert verb != "create" or not labels, f"namespace {name} created twice"
            labels.update(dict(p.split("=", 1) for p in pairs))
            return
        collection = "/api/v1/nodes"
        if verb == "create" or self.kube("GET", f"{collection}/{name}") is None:  # kmock starts with no nodes
            self.kube("POST", collection, {"apiVersion": "v1", "kind": kind.capitalize(), "metadata": {"name": name}})
        if verb in ("label", "annotate"):
            field = "labels" if verb == "label" else "annotations"
            self.kube("PATCH", f"{collection}/{name}", {"metadata": {field: dict(p.split("=", 1) for p in pairs)}},
                      merge=True)

    def kubectl_apply(self, argv: list[str], stdin: str) -> None:
        if argv[-1] == "-":
            body = yaml.safe_load(stdin)
            crd = one(self.docs, "CustomResourceDefinition")
            schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            jsonschema.Draft7Validator(schema).validate(apply_defaults(schema, body))
            assert body["spec"]["index"]["image"] == body["spec"]["sidecar"]["image"] == self.image_tag
            meta = body["metadata"]
            self.kube("POST", f"/apis/maru.io/v1alpha1/namespaces/{meta['namespace']}/marucaches", body)
            self.cache = (meta["namespace"], meta["name"])
            return
        assert argv[-1] == "vllm.yaml", argv
        self.vllm_deployment()

    def kubectl_wait(self, argv: list[str]) -> None:
        namespace, name = self.cache
        assert argv[2] == f"mcache/{name}" and flag(argv, "-n") == namespace
        assert flag(argv, "--for") == "condition=Ready"
        index = wait_for(lambda: self.kube("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/"
                                                  f"{name}-maru-index"), what="the index Deployment")
        validate_strict(self.tmp, [index], "index")
        pod = index["spec"]["template"]["spec"]
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and not [v for v in pod["volumes"] if "hostPath" in v]
        assert restricted_violations(pod) == []  # admitted whatever the namespace enforces
        assert pod["containers"][0]["resources"]["limits"]["squat.ai/dax0.0"] == "1"
        self.kube("PATCH", f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}-maru-index/status",
                  {"status": {"availableReplicas": 1, "readyReplicas": 1, "replicas": 1}}, merge=True)
        wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True" for c in
                             (self.cached().get("status") or {}).get("conditions") or ()), what="the cache Ready")

    def cached(self) -> dict[str, Any]:
        namespace, name = self.cache
        return self.kube("GET", f"/apis/maru.io/v1alpha1/namespaces/{namespace}/marucaches/{name}")

    def kubectl_get_mcache(self, argv: list[str]) -> None:
        status = self.cached()["status"]
        assert status["phase"] == "Ready" and status["allocations"][0]["size"] == 64 << 30

    # -- the vLLM user --------------------------------------------------------------------------

    def pip_wheel(self, argv: list[str]) -> None:
        assert argv[:3] == ["python", "-m", "pip"]
        source = self.tmp / "release"
        source.mkdir()
        for name in PACKAGE_FILES:  # the release's files, so the build writes nothing into the tree
            (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(ROOT / name, source / name)
        subprocess.run([sys.executable, *argv[1:], "-q"], cwd=source, check=True, timeout=300, capture_output=True)
        self.wheels = sorted(p.name for p in (source / "dist").glob("*.whl"))

    def docker_build(self, argv: list[str]) -> None:
        assert flag(argv, "-f") == "Dockerfile.vllm"
        (recipe,) = fenced("dockerfile")
        copied = re.search(r"^COPY dist/(\S+) ", recipe, re.M).group(1)
        assert self.wheels == [copied], "Dockerfile.vllm must copy the wheel `pip wheel` makes"
        assert re.search(r"^FROM vllm/vllm-openai:v\d+\.\d+\.\d+$", recipe, re.M), "pin the upstream vLLM image"
        path = self.tmp / "Dockerfile.vllm"
        path.write_text(recipe)
        assert HADOLINT, "hadolint is not installed: pip install -e '.[test]'"
        lint = subprocess.run([HADOLINT, "--ignore", "DL3013", str(path)], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr  # DL3013 (pin pip versions) fits no local wheel

    def vllm_deployment(self) -> None:
        (block,) = [b for b in fenced("yaml") if b.startswith("# vllm.yaml")]
        deployment = yaml.safe_load(block)
        validate_strict(self.tmp, [deployment], "vllm")
        template = deployment["spec"]["template"]
        assert is_guaranteed(template["spec"]), "the example pod must be Guaranteed before injection"
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**copy.deepcopy(template["metadata"]), "name": "llama-5d8f9c7b6-x2k9q",
                            "namespace": deployment["metadata"]["namespace"]},
               "spec": copy.deepcopy(template["spec"])}
        injected = wait_for(lambda: (p := self.admit(pod)) is not pod and p, what="the webhook injected it")
        validate_strict(self.tmp, [injected], "injected")
        spec = injected["spec"]
        sidecar = spec["initContainers"][0]  # kmock says Kubernetes 1.30: a native sidecar
        assert sidecar["name"] == "maru-sidecar" and sidecar["restartPolicy"] == "Always"
        assert sidecar["image"] == self.image_tag
        assert spec["containers"][0]["args"][-2:] == ["--kv-transfer-config", "$(MARU_KV_TRANSFER_CONFIG)"]
        assert is_guaranteed(spec), "the sidecar must keep a Guaranteed pod Guaranteed"
        assert self.level(injected["metadata"]["namespace"]) == "baseline" and baseline_violations(spec) == []
        assert restricted_violations(spec, containers=["maru-sidecar"]) == []
        assert injected["metadata"]["annotations"]["maru.io/injected"] == self.cache[1]

    def admit(self, pod: dict[str, Any]) -> dict[str, Any]:
        """An AdmissionReview over HTTPS as the API server sends it, trusting only the chart's CA."""
        run = self.run
        port = int(run.webhook_url.split(":")[2].split("/")[0])
        pool = urllib3.HTTPSConnectionPool("127.0.0.1", port, cert_reqs="CERT_REQUIRED", ca_certs=str(run.ca_file),
                                           server_hostname=run.webhook_host, assert_hostname=run.webhook_host)
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                  "request": {"uid": "install-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                              "resource": {"group": "", "version": "v1", "resource": "pods"},
                              "namespace": pod["metadata"]["namespace"], "operation": "CREATE", "object": pod,
                              "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
                              "dryRun": False}}
        resp = pool.request("POST", "/inject", body=json.dumps(review), headers={"Content-Type": "application/json"})
        answer = json.loads(resp.data)["response"]
        assert answer["allowed"] is True
        if not answer.get("patch"):
            return pod
        patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(answer["patch"])))
        return patched if "maru.io/injected" in patched["metadata"].get("annotations", {}) else pod


def step(j: Journey, argv: list[str], stdin: str) -> str:
    """Run one command of the page; what was done with it."""
    words = " ".join(argv[:3])
    handlers = [
        (argv[:2] == ["make", "image"], lambda: j.make_image(argv)),
        (argv[:2] == ["helm", "install"], lambda: j.helm_install(argv)),
        (argv[:2] == ["kubectl", "apply"], lambda: j.kubectl_apply(argv, stdin)),
        (argv[:2] == ["kubectl", "wait"], lambda: j.kubectl_wait(argv)),
        (argv[:3] == ["kubectl", "get", "mcache"], lambda: j.kubectl_get_mcache(argv)),
        (argv[:2] in (["kubectl", "create"], ["kubectl", "label"], ["kubectl", "annotate"]),
         lambda: j.kubectl_object(argv)),
        (argv[:4] == ["python", "-m", "pip", "wheel"], lambda: j.pip_wheel(argv)),
        (argv[:2] == ["docker", "build"], lambda: j.docker_build(argv)),
        (argv[:2] == ["docker", "push"], lambda: j.docker_push(argv)),
    ]
    for matches, action in handlers:
        if matches:
            action()
            return "run"
    reason = next((why for prefix, why in NOT_RUN.items() if words.startswith(prefix)), None)
    assert reason, f"docs/install.md has a command this test does not know: {' '.join(argv)}"
    return "not run"


def test_every_command_of_the_install_page_in_order(tmp_path):
    steps = commands()
    assert len(steps) >= 20
    with KmockCluster() as cluster:
        journey = Journey(tmp_path, cluster)
        try:
            outcomes = [step(journey, argv, stdin) for argv, stdin in steps]
        finally:
            if journey.run is not None:
                journey.run.operator.__exit__(None, None, None)
    ran = [" ".join(argv[:3]) for (argv, _), outcome in zip(steps, outcomes) if outcome == "run"]
    assert len(ran) >= 14, ran  # most of the page really ran
