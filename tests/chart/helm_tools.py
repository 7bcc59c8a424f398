"""The real `helm` binary and the chart's rendered manifests, for the chart tests."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "marucache"
VENV_BIN = pathlib.Path(sys.executable).parent
HELM = str(VENV_BIN / "helm") if (VENV_BIN / "helm").exists() else shutil.which("helm")
KUBERNETES_VALIDATE = str(VENV_BIN / "kubernetes-validate")
RELEASE, NAMESPACE = "mc", "maru-system"

# Every optional feature on (the monitors are exclusive: PodMonitor here, ServiceMonitor in ALL_FEATURES_SM).
ALL_FEATURES = {
    "crds": {"enabled": True, "keep": True},
    "webhook": {"enabled": True, "namespaceSelector": {"matchLabels": {"maru.io/inject": "enabled"}},
                "annotations": {"example.com/owner": "ml-platform"}},
    "monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}},
                   "prometheusRule": {"enabled": True, "labels": {"release": "kps"},
                                      "alertLabels": {"team": "ml"}}},
    "dashboards": {"enabled": True, "annotations": {"grafana_folder": "MaruCache"}},
    "commonLabels": {"example.com/env": "test"},
    "operator": {"extraArgs": ["--resync-seconds=7"], "podAnnotations": {"example.com/a": "b"},
                 "podLabels": {"example.com/l": "v"}, "nodeSelector": {"kubernetes.io/os": "linux"},
                 "tolerations": [{"key": "ml", "operator": "Exists", "effect": "NoSchedule"}],
                 "imagePullSecrets": [{"name": "regcred"}], "priorityClassName": "marucache-index",
                 "extraEnv": [{"name": "PYTHONUNBUFFERED", "value": "1"}]},
    "serviceAccount": {"annotations": {"example.com/role": "operator"}},
    "devicePlugin": {"enabled": True, "count": 16, "devices": ["dax0.0", "dax1.0"],
                     "image": {"digest": "sha256:" + "cd" * 32}},
}
ALL_FEATURES_SM = {**ALL_FEATURES, "monitoring": {"serviceMonitor": {"enabled": True},
                                                  "prometheusRule": {"enabled": True}}}


class HelmFailed(AssertionError):
    def __init__(self, args: list[str], stderr: str):
        super().__init__(f"helm {' '.join(args)} failed:\n{stderr}")
        self.stderr = stderr


def helm(*args: str, values: Mapping[str, Any] | None = None, tmp: pathlib.Path | None = None) -> str:
    """Run helm; with `values`, they are passed as a values file (written under `tmp`)."""
    assert HELM, "helm is not installed: run scripts/bootstrap.sh (it puts helm into .venv/bin)"
    argv = list(args)
    if values is not None:
        assert tmp is not None
        path = tmp / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
        path.write_text(yaml.safe_dump(dict(values)))
        argv += ["--values", str(path)]
    run = subprocess.run([HELM, *argv], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise HelmFailed(argv, run.stderr)
    return run.stdout


def render(tmp: pathlib.Path, values: Mapping[str, Any] | None = None, release: str = RELEASE,
           namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """`helm template` of the chart: every rendered document, parsed."""
    out = helm("template", release, str(CHART), "--namespace", namespace, values=values or {}, tmp=tmp)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(docs: Iterable[Mapping[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [dict(d) for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: Iterable[Mapping[str, Any]], kind: str) -> dict[str, Any]:
    found = find(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def operator_args(docs: Iterable[Mapping[str, Any]]) -> list[str]:
    """`marucache operator ARGS` of the rendered operator Deployment (ARGS only)."""
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["marucache", "operator"], container["command"]
    return list(container["args"])


def operator_cluster_role(docs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The operator's own ClusterRole (the others are aggregated into the default user roles)."""
    (role,) = [d for d in find(docs, "ClusterRole") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"]
    return role


def alert_rules(docs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The PrometheusRule's `spec` (a Prometheus rule file: `groups`)."""
    return one(docs, "PrometheusRule")["spec"]
