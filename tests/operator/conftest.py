"""Fixtures of the operator tests: a kmock cluster with nodes, the operator in a thread."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from kube_helpers import DAX_NODES, Kube
from maru_operator.cli import OperatorOptions
from maru_tools.kube_emulator import KmockCluster, OperatorThread


@pytest.fixture
def cluster() -> Iterator[KmockCluster]:
    with KmockCluster() as c:
        yield c


@pytest.fixture
def kube(cluster: KmockCluster) -> Kube:
    k = Kube(cluster)
    for name, (labels, node_annotations) in DAX_NODES.items():
        k.add_node(name, labels, node_annotations)
    return k


@pytest.fixture
def options(cluster: KmockCluster, tmp_path: pathlib.Path) -> OperatorOptions:
    return OperatorOptions(kubeconfig=str(cluster.write_kubeconfig(tmp_path / "kubeconfig")),
                           resync_seconds=0.2, metrics_port=None, webhook=False, usage_seconds=0)


@pytest.fixture
def operator(options: OperatorOptions, kube: Kube) -> Iterator[OperatorThread]:
    with OperatorThread(options) as op:
        yield op
