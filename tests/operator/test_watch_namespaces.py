"""The operator scoped to a list of namespaces (`--watch-namespace`), run for real against kmock: it
reconciles the caches of those namespaces, leaves every other namespace alone (no call there, no
cluster-wide list or watch of a namespaced resource), and keeps the ledger's claims and draining
regions of caches it cannot see."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time

import pytest

from kube_helpers import Kube, condition, wait_for
from maru_operator.cli import add_arguments, options_from_args, run_operator
from maru_operator.ledger import Claim, Drain, Ledger, Region
from maru_operator.models import CacheRef
from maru_tools.kube_emulator import KmockCluster, OperatorThread

GiB = 1 << 30
LEDGER = "/api/v1/namespaces/maru-system/configmaps/marucache-ledger"
# Namespaced resources the operator reads or writes; nodes and discovery are cluster-scoped.
NAMESPACED = ("marucaches", "pods", "deployments", "configmaps", "secrets", "services", "networkpolicies",
              "events", "leases")


def parse(*argv: str) -> tuple[str, ...]:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return options_from_args(parser.parse_args(list(argv))).watch_namespaces


def test_the_flag_takes_repeated_and_comma_separated_namespaces():
    assert parse() == ()  # cluster-wide, as before
    assert parse("--watch-namespace", "team-a", "--watch-namespace", "team-b, team-c,team-a") == (
        "team-a", "team-b", "team-c")


@pytest.mark.parametrize("value", ["Team_A", "team-*", "-team", "a" * 64, ","])
def test_a_value_that_names_no_namespace_is_refused_with_what_to_change(value, capsys):
    with pytest.raises((SystemExit, argparse.ArgumentError)) as exc:
        parse(f"--watch-namespace={value}")
    message = str(exc.value) + capsys.readouterr().err
    assert "not a namespace name" in message or "leave the flag out" in message, message


def operator_requests(cluster: KmockCluster) -> list[tuple[str, str]]:
    """(method, path) of every request the operator sent (the test's own come from python-requests)."""
    def snapshot() -> list[tuple[str, str]]:
        return [(r.method.value, r.url.path) for r in cluster.emulator
                if not str(r.headers.get("User-Agent", "")).startswith("python-requests")]
    return cluster.call(snapshot)


def resource_of(path: str) -> tuple[str | None, str | None]:
    """(namespace, resource) a request path names; (None, None) for discovery and /version."""
    parts = path.strip("/").split("/")
    rest = parts[2:] if parts[0] == "api" else parts[3:] if parts[0] == "apis" else []
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    return namespace, rest[0] if rest else None


def test_a_scoped_operator_reconciles_its_namespaces_and_touches_no_other(kube: Kube, options, cluster):
    kube.apply_cache("outside", {"pool": {"deviceClass": "dax", "size": "2Gi"}}, ns="team-b")
    with OperatorThread(dataclasses.replace(options, watch_namespaces=("team-a",))):
        kube.apply_cache("inside", {"pool": {"deviceClass": "dax", "size": "2Gi"}}, ns="team-a")
        wait_for(lambda: ("team-a", "inside-maru-index") in kube.objects("apps/v1/deployments"), what="index")
        kube.make_index_available("inside", ns="team-a")
        wait_for(lambda: (condition(kube.cache("inside", "team-a"), "Ready") or {}).get("status") == "True",
                 what="the cache of the watched namespace Ready")
        time.sleep(1.0)  # five resync periods: time for the other cache to be touched, were it seen
        requests = operator_requests(cluster)
    outside = kube.cache("outside", "team-b")
    assert not outside["metadata"].get("finalizers") and not outside.get("status"), outside
    assert not outside["metadata"].get("annotations"), outside  # no kopf progress or diff-base
    for resource in ("v1/configmaps", "v1/secrets", "v1/services", "apps/v1/deployments", "v1/events"):
        assert not [key for key in kube.objects(resource) if key[0] == "team-b"], resource
    assert [c["namespace"] for c in kube.ledger()] == ["team-a"]
    # Every namespaced call stays in the watched namespace, or the release namespace (ledger, Lease);
    # nothing namespaced is listed or watched across all namespaces.
    called = [(method, *resource_of(path)) for method, path in requests]
    assert {r for _, _, r in called} >= {"marucaches", "deployments", "pods", "configmaps", "events", "nodes"}
    elsewhere = [c for c in called if c[2] in NAMESPACED and c[1] not in ("team-a", "maru-system")]
    assert not elsewhere, elsewhere


def seed_ledger(kube: Kube, ledger: Ledger) -> None:
    kube.request("POST", "/api/v1/namespaces/maru-system/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "marucache-ledger", "namespace": "maru-system"},
        "data": {"ledger.json": ledger.to_json()}})


def test_claims_and_drains_of_caches_outside_the_namespaces_are_kept(kube: Kube, options):
    """A cache of a namespace the operator does not watch may exist, and its pods may map a draining
    region: its claim and drain stay, and no watched cache gets their bytes."""
    kept = Claim(CacheRef("team-b", "kept", "uid-kept"), "dax", Region("cxl-a", 0, 2 * GiB))
    moved = Drain(CacheRef("team-b", "moved", "uid-moved"), "dax", Region("cxl-a", 2 * GiB, 2 * GiB), "p1")
    seed_ledger(kube, Ledger((kept,), (moved,)))
    with OperatorThread(dataclasses.replace(options, watch_namespaces=("team-a",))):
        kube.apply_cache("new", {"pool": {"deviceClass": "dax", "size": "2Gi"}}, ns="team-a")
        alloc = wait_for(lambda: ((kube.cache("new", "team-a") or {}).get("status") or {}).get("allocations"),
                         what="allocation")[0]
        time.sleep(1.0)  # resyncs settle drains: one the operator cannot see must stay
        ledger = json.loads(kube.request("GET", LEDGER)["data"]["ledger.json"])
    assert alloc["offset"] == 4 * GiB, alloc
    assert {(c["namespace"], c["name"]) for c in ledger["claims"]} == {("team-b", "kept"), ("team-a", "new")}
    assert [d["uid"] for d in ledger.get("draining", [])] == ["uid-moved"]


def test_a_scoped_operator_waits_for_the_marucache_resource_to_be_served(kube: Kube, options, cluster, caplog):
    """kopf's scanning is off when scoped (no CRD watch): a CRD established after the operator started
    is found because the operator waits for it in the API's discovery before kopf starts."""
    resources = cluster.emulator.resources
    key = next(r for r in resources if r.plural == "marucaches")
    info = cluster.call(lambda: resources.pop(key))
    operator = OperatorThread(dataclasses.replace(options, watch_namespaces=("team-a",)))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = pool.submit(operator.__enter__)
        wait_for(lambda: "does not serve maru.io/v1alpha1/marucaches yet" in caplog.text, what="the wait logged")
        assert not started.done()
        cluster.call(lambda: resources.__setitem__(key, info))  # the CRD is established
        started.result(timeout=60)
    try:
        kube.apply_cache("late", {"pool": {"deviceClass": "dax", "size": "2Gi"}}, ns="team-a")
        wait_for(lambda: ((kube.cache("late", "team-a") or {}).get("status") or {}).get("allocations"),
                 what="the cache reconciled")
    finally:
        operator.stop()


def test_a_scoped_operator_waiting_for_the_resource_stops_when_asked(options, cluster, caplog):
    resources = cluster.emulator.resources
    key = next(r for r in resources if r.plural == "marucaches")
    cluster.call(lambda: resources.pop(key))
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(asyncio.run, run_operator(dataclasses.replace(options, watch_namespaces=("team-a",)),
                                                        stop_flag=stop))
        wait_for(lambda: "does not serve maru.io/v1alpha1/marucaches yet" in caplog.text, what="the wait logged")
        stop.set()
        assert running.result(timeout=5) is None  # returned, kopf never started
