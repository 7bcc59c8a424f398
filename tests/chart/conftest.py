"""Fixtures of the chart tests: the real operator started from the chart's own Deployment args and
TLS Secret against kmock, live for the session (`chart_operator`)."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator

import pytest
from chart_operator import NODES, OperatorRun, chart_options
from helm_tools import ROOT, find, one, render

from maru_tools.kube_emulator import KmockCluster, OperatorThread

# The sidecar tests' helpers (real sidecar, stats writers, Prometheus) are shared with these tests.
sys.path.insert(0, str(ROOT / "tests" / "sidecar"))


@pytest.fixture(scope="session")
def operator_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorRun]:
    tmp = tmp_path_factory.mktemp("chart-operator")
    docs = render(tmp)
    hook = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    ca_file = tmp / "ca.crt"
    ca_file.write_bytes(base64.b64decode(hook["clientConfig"]["caBundle"]))
    with KmockCluster() as cluster:
        options = chart_options(docs, tmp, cluster.write_kubeconfig(tmp / "kubeconfig"))
        # The CRD the chart installs, so kopf's discovery finds the resource it watches.
        run = OperatorRun(cluster, OperatorThread(options), docs, f"https://127.0.0.1:{options.webhook_port}/inject",
                          options.webhook_host, ca_file, options.metrics_port)
        run.kube("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                 find(docs, "CustomResourceDefinition")[0])
        for name, (labels, annotations) in NODES.items():
            run.kube("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                               "metadata": {"name": name, "labels": labels,
                                                            "annotations": annotations}})
        with run.operator:
            yield run
