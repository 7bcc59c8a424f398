"""The per-cache readiness and phase metrics of the real operator against kmock."""

from __future__ import annotations

from kube_helpers import Kube, wait_for
from maru_tools.kube_emulator import OperatorThread


def sample(operator: OperatorThread, name: str, **labels: str) -> float | None:
    return operator.metrics.registry.get_sample_value(name, labels)


def test_ready_and_phase_follow_the_status_and_go_with_the_cache(kube: Kube, operator: OperatorThread):
    kube.apply_cache("watched", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
    wait_for(lambda: sample(operator, "maru_cache_phase", namespace="default", cache="watched", phase="Starting") == 1,
             what="phase Starting exported")
    assert sample(operator, "maru_cache_ready", namespace="default", cache="watched") == 0
    for other in ("Ready", "Pending", "Invalid"):
        assert sample(operator, "maru_cache_phase", namespace="default", cache="watched", phase=other) == 0, other
    kube.make_index_available("watched")
    wait_for(lambda: sample(operator, "maru_cache_ready", namespace="default", cache="watched") == 1,
             what="Ready exported")
    assert sample(operator, "maru_cache_phase", namespace="default", cache="watched", phase="Ready") == 1
    assert sample(operator, "maru_cache_phase", namespace="default", cache="watched", phase="Starting") == 0
    kube.delete_cache("watched")
    wait_for(lambda: sample(operator, "maru_cache_ready", namespace="default", cache="watched") is None,
             what="series removed with the cache")
    assert sample(operator, "maru_cache_phase", namespace="default", cache="watched", phase="Ready") is None


def test_an_unsatisfiable_cache_is_exported_as_invalid(kube: Kube, operator: OperatorThread):
    kube.apply_cache("huge", {"pool": {"deviceClass": "dax", "size": "900Gi"}}, ns="team-b")
    wait_for(lambda: sample(operator, "maru_cache_phase", namespace="team-b", cache="huge", phase="Invalid") == 1,
             what="phase Invalid exported")
    assert sample(operator, "maru_cache_ready", namespace="team-b", cache="huge") == 0
    assert sample(operator, "maru_cache_phase", namespace="team-b", cache="huge", phase="Pending") == 0
