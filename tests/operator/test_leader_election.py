"""Two real operators against kmock with leader election: only the Lease holder reconciles, the other
takes over when the holder stops, and never before a Lease nobody renews has run out."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import requests

from kube_helpers import Kube, wait_for
from maru_operator.cli import OperatorOptions
from maru_operator.metrics import RESULTS
from maru_tools.index_process import free_port
from maru_tools.kube_emulator import OperatorThread

LEASES = "/apis/coordination.k8s.io/v1/namespaces/maru-system/leases"
LEASE_SECONDS = 5.0  # renewals every 0.7 s, given up after 3.3 s: room for a loaded test machine


def reconciles(operator: OperatorThread) -> float:
    registry = operator.metrics.registry
    return sum(registry.get_sample_value("maru_operator_reconciles_total", {"result": r}) or 0 for r in RESULTS)


def leading(operator: OperatorThread) -> bool:
    return operator.metrics.registry.get_sample_value("maru_operator_leader") == 1


def elected(options: OperatorOptions, identity: str) -> OperatorThread:
    return OperatorThread(dataclasses.replace(options, leader_election=True, identity=identity,
                                              lease_seconds=LEASE_SECONDS))


@pytest.fixture
def pair(options: OperatorOptions, kube: Kube) -> Iterator[tuple[OperatorThread, OperatorThread]]:
    first, second = elected(options, "op-a"), elected(options, "op-b")
    with first, second:
        yield first, second


def test_only_the_lease_holder_reconciles_and_the_other_takes_over(kube: Kube, pair):
    first, second = pair
    leader = wait_for(lambda: next((op for op in pair if leading(op)), None), what="a leader")
    waiting = second if leader is first else first
    kube.apply_cache("one", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
    wait_for(lambda: (kube.cache("one") or {}).get("status", {}).get("phase") == "Starting", what="reconciled")
    time.sleep(1.0)  # resync timers run every 0.2 s: a second reconciler would have run by now
    assert reconciles(leader) >= 1 and reconciles(waiting) == 0 and not leading(waiting)
    assert leader.error is None and waiting.error is None
    lease = kube.request("GET", f"{LEASES}/marucache-operator")
    assert lease["spec"]["holderIdentity"] == ("op-a" if leader is first else "op-b")
    leader.stop()  # a clean stop hands the Lease back: no wait for it to run out
    wait_for(lambda: leading(waiting), timeout=LEASE_SECONDS, what="the other replica leads")
    kube.apply_cache("two", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
    wait_for(lambda: (kube.cache("two") or {}).get("status", {}).get("phase") == "Starting", what="reconciled")
    assert reconciles(waiting) >= 1
    assert len(kube.ledger()) == 2


def test_a_lease_nobody_renews_is_taken_over_only_after_it_runs_out(kube: Kube, options: OperatorOptions):
    # A holder that died without handing the Lease back (SIGKILL, a lost node).
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    kube.request("POST", LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                  "metadata": {"name": "marucache-operator", "namespace": "maru-system"},
                                  "spec": {"holderIdentity": "dead", "leaseDurationSeconds": int(LEASE_SECONDS),
                                           "renewTime": now, "acquireTime": now, "leaseTransitions": 0}})
    kube.apply_cache("orphan", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
    started = time.monotonic()
    with elected(options, "op-b") as operator:
        wait_for(lambda: leading(operator), timeout=LEASE_SECONDS * 5, what="leadership")
        waited = time.monotonic() - started
        assert waited >= LEASE_SECONDS, f"took over a live Lease after {waited:.1f} s"
        wait_for(lambda: (kube.cache("orphan") or {}).get("status", {}).get("phase") == "Starting",
                 what="reconciled by the new leader")
        lease = kube.request("GET", f"{LEASES}/marucache-operator")["spec"]
        assert lease["holderIdentity"] == "op-b" and lease["leaseTransitions"] == 1


def test_a_waiting_replica_never_writes_to_a_cache(kube: Kube, options: OperatorOptions):
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    kube.request("POST", LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                  "metadata": {"name": "marucache-operator", "namespace": "maru-system"},
                                  "spec": {"holderIdentity": "elsewhere", "leaseDurationSeconds": 3600,
                                           "renewTime": now, "acquireTime": now, "leaseTransitions": 0}})
    kube.apply_cache("untouched", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
    with elected(options, "op-b") as operator:
        time.sleep(2.0)
        assert not leading(operator) and reconciles(operator) == 0
    body = kube.cache("untouched")
    assert "status" not in body and not body["metadata"].get("finalizers"), body
    assert not (body["metadata"].get("annotations") or {}), body["metadata"]


def listen_port(taken: set[int]) -> int:
    """A free port below the ephemeral range (``free_port``): the webhook and liveness ports are
    bound again at a takeover, seconds after they were picked."""
    for _ in range(50):
        port = free_port()
        if port not in taken:
            taken.add(port)
            return port
    raise AssertionError("no free port below the ephemeral range")


def injects(url: str) -> bool:
    from test_webhook import pod, review

    try:
        return len(review(url, pod("shared"))[1]["spec"]["containers"]) == 2
    except requests.ConnectionError:
        return False


def test_the_waiting_replica_serves_the_webhook_like_the_leader(kube: Kube, options: OperatorOptions):
    """The operator's Service sends admission reviews to every replica: a waiting one injects too."""
    from test_webhook import pod, review

    ports: dict[str, int] = {}
    replicas = []
    taken: set[int] = set()
    for identity in ("op-a", "op-b"):
        ports[identity] = listen_port(taken)
        replicas.append(OperatorThread(dataclasses.replace(
            options, leader_election=True, identity=identity, lease_seconds=LEASE_SECONDS, webhook=True,
            webhook_insecure=True, webhook_addr="127.0.0.1", webhook_port=ports[identity], native_sidecars="never",
            liveness=f"http://127.0.0.1:{listen_port(taken)}/healthz")))
    with replicas[0], replicas[1]:
        kube.apply_cache("shared", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
        wait_for(lambda: (kube.cache("shared").get("status") or {}).get("allocations"), what="allocation")
        waiting = next(identity for identity, op in zip(ports, replicas) if not leading(op))
        url = f"http://127.0.0.1:{ports[waiting]}/inject"
        # its webhook server may not listen yet: connections refused until it does
        wait_for(lambda: injects(url), what="the waiting replica injects")
        injected = review(url, pod("shared"))[1]
        assert len(injected["spec"]["containers"]) == 2
        assert injected["metadata"]["annotations"]["maru.io/injected"] == "shared"
        follower = replicas[list(ports).index(waiting)]
        assert not leading(follower)
        # The leader goes; the follower restarts kopf as leader on the same webhook and liveness ports.
        next(op for op in replicas if op is not follower).stop()
        wait_for(lambda: leading(follower), timeout=LEASE_SECONDS * 2, what="the follower leads")
        # Its webhook server is down for the moment kopf takes to start again (docs/operator.md).
        wait_for(lambda: injects(url), what="the new leader injects")
        assert requests.get(follower.options.liveness, timeout=5).status_code == 200
        assert all(op.error is None for op in replicas), [op.error for op in replicas]
