"""Fixtures of the chart tests: the real operator started from the chart's own Deployment args and
TLS Secret against kmock, live for the session (`chart_operator`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from chart_operator import OperatorRun, chart_operator
from helm_tools import ROOT, render

# The sidecar tests' helpers (real sidecar, stats writers, Prometheus) are shared with these tests.
sys.path.insert(0, str(ROOT / "tests" / "sidecar"))


@pytest.fixture(scope="session")
def operator_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorRun]:
    tmp = tmp_path_factory.mktemp("chart-operator")
    with chart_operator(render(tmp), tmp) as run:
        yield run
