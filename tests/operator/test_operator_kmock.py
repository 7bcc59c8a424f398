"""The real kopf operator against kmock: create, update, concurrency, delete, restart, bad specs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from kube_helpers import Kube, condition, wait_for
from maru_operator import reconciler
from maru_operator.inventory import parse_node
from maru_operator.k8s import KubeApi, LedgerStore, load_configuration
from maru_tools.kube_emulator import OperatorThread

GiB = 1 << 30


def ready(kube: Kube, name: str) -> dict:
    return wait_for(lambda: (c := kube.cache(name)) and (condition(c, "Ready") or {}).get("status") == "True" and c,
                    what=f"{name} Ready")


def test_create_makes_children_and_becomes_ready(kube: Kube, operator: OperatorThread):
    kube.apply_cache("demo", {"pool": {"deviceClass": "dax", "size": "4Gi"}, "storage": {"chunkTokens": 512}})
    body = wait_for(lambda: (c := kube.cache("demo")) and (condition(c, "DevicesAllocated") or {}).get(
        "status") == "True" and c, what="allocation")
    assert condition(body, "Ready")["status"] == "False" and body["status"]["phase"] == "Starting"
    uid = body["metadata"]["uid"]
    for resource, name in [("v1/configmaps", "demo-maru-config"), ("v1/secrets", "demo-maru-token"),
                           ("apps/v1/deployments", "demo-maru-index"), ("v1/services", "demo-maru-index"),
                           ("networking.k8s.io/v1/networkpolicies", "demo-maru-index")]:
        child = kube.objects(resource)[("default", name)]
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid, resource
    config = json.loads(kube.objects("v1/configmaps")[("default", "demo-maru-config")]["data"]["kv-transfer-config.json"])
    extra = config["kv_connector_extra_config"]
    assert config["kv_connector"] == "MaruKVConnector" and config["kv_load_failure_policy"] == "recompute"
    assert extra["maru_index_url"] == "tcp://demo-maru-index.default.svc:7070" and extra["maru_kv_chunk_tokens"] == 512
    assert extra["maru_token_file"] == "/var/run/maru-token/token"  # what pods of an earlier operator read
    data = kube.objects("v1/configmaps")[("default", "demo-maru-config")]["data"]
    pods = json.loads(data["kv-transfer-config-credential.json"])["kv_connector_extra_config"]
    assert pods == {**extra, "maru_token_file": "/var/run/maru/credential"}  # injected pods: their own credential
    deploy = kube.objects("apps/v1/deployments")[("default", "demo-maru-index")]
    command = deploy["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["marucache", "index", "--pool", "/dev/dax0.0"] and "--token-file" in command
    kube.make_index_available("demo")
    body = ready(kube, "demo")
    assert body["status"]["phase"] == "Ready" and body["status"]["observedGeneration"] == 1
    alloc = body["status"]["allocations"][0]
    assert alloc["deviceUUID"] == "cxl-a" and alloc["nodes"] == ["rack-a-1", "rack-a-2"] and alloc["size"] == 4 * GiB
    wait_for(lambda: {e["reason"] for e in kube.events()} >= {"Allocated", "Created"}, what="events")
    assert operator.metrics.registry.get_sample_value("maru_operator_reconciles_total", {"result": "progressing"}) >= 1
    assert operator.metrics.registry.get_sample_value("maru_operator_reconcile_duration_seconds_count") >= 1


def test_spec_change_updates_children_but_never_the_token(kube: Kube, operator: OperatorThread):
    kube.apply_cache("edit", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
    wait_for(lambda: ("default", "edit-maru-config") in kube.objects("v1/configmaps"), what="config map")
    token = kube.objects("v1/secrets")[("default", "edit-maru-token")]["stringData"]["token"]
    kube.patch_cache("edit", {"storage": {"layout": "layerwise", "chunkTokens": 128},
                              "pool": {"deviceClass": "dax", "size": "6Gi"}})

    def updated():
        cm = kube.objects("v1/configmaps")[("default", "edit-maru-config")]
        extra = json.loads(cm["data"]["kv-transfer-config.json"])["kv_connector_extra_config"]
        # the format's older spelling, which every release's connector reads (docs/operator.md)
        return extra["maru_use_layerwise"] is True and extra["maru_kv_chunk_tokens"] == 128
    wait_for(updated, what="config map update")
    wait_for(lambda: str(6 * GiB) in kube.objects("apps/v1/deployments")[("default", "edit-maru-index")][
        "spec"]["template"]["spec"]["containers"][0]["command"], what="index Deployment on the new region")
    body = wait_for(lambda: (c := kube.cache("edit")) and (c.get("status") or {}).get("observedGeneration") == 2 and c)
    assert body["status"]["allocations"][0]["size"] == 6 * GiB, json.dumps([body, kube.ledger()])
    assert [c["size"] for c in kube.ledger()] == [6 * GiB]
    assert kube.objects("v1/secrets")[("default", "edit-maru-token")]["stringData"]["token"] == token


def test_caches_created_at_once_get_disjoint_regions(kube: Kube, operator: OperatorThread):
    for i in range(6):
        kube.apply_cache(f"c{i}", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
    wait_for(lambda: len(kube.ledger()) == 6, what="six claims")
    claims = sorted((c["device"], c["offset"], c["size"]) for c in kube.ledger())
    for (d1, o1, s1), (d2, o2, _) in zip(claims, claims[1:]):
        assert d1 != d2 or o1 + s1 <= o2, claims
    bodies = [wait_for(lambda i=i: (c := kube.cache(f"c{i}")) and c.get("status", {}).get("allocations") and c)
              for i in range(6)]
    assert sorted(b["status"]["allocations"][0]["offset"] for b in bodies) == sorted(o for _, o, _ in claims)


def test_delete_returns_the_region(kube: Kube, operator: OperatorThread):
    kube.apply_cache("gone", {"pool": {"deviceClass": "shm", "size": "6Gi"}})
    wait_for(lambda: len(kube.ledger()) == 1, what="claim")
    kube.apply_cache("waiting", {"pool": {"deviceClass": "shm", "size": "4Gi"}})  # 8Gi node: must wait
    waiting = wait_for(lambda: (c := kube.cache("waiting")) and (condition(c, "DevicesAllocated") or {}).get(
        "reason") == "InsufficientCapacity" and c, what="waiting for capacity")
    assert waiting["status"]["phase"] == "Pending"
    kube.delete_cache("gone")
    wait_for(lambda: kube.cache("gone") is None, what="finalizer removed")
    wait_for(lambda: kube.events("Released"), what="Released event")
    wait_for(lambda: [c["name"] for c in kube.ledger()] == ["waiting"], what="region handed to the waiting cache")


def test_operator_restarted_mid_reconcile_converges_without_a_second_allocation(kube, options, cluster):
    cluster.emulator.fail("PATCH", "/marucaches/crash/status", 500, sticky=True)  # the status never lands
    with OperatorThread(options):
        kube.apply_cache("crash", {"pool": {"deviceClass": "dax", "size": "3Gi"}})
        wait_for(lambda: kube.ledger() and ("default", "crash-maru-index") in kube.objects("apps/v1/deployments"),
                 what="claim and children written")
        assert not (kube.cache("crash").get("status") or {}).get("allocations")
        before = kube.ledger()
    cluster.call(lambda: cluster.emulator.faults.clear())
    with OperatorThread(options):
        kube.make_index_available("crash")
        body = ready(kube, "crash")
    assert kube.ledger() == before and len(before) == 1
    alloc = body["status"]["allocations"][0]
    assert (alloc["deviceUUID"], alloc["offset"], alloc["size"]) == (before[0]["device"], before[0]["offset"],
                                                                     before[0]["size"])


@pytest.mark.parametrize("spec, fix", [
    ({"pool": {"deviceClass": "dax", "size": "4Gi"}, "storage": {"chunkTokens": 96, "blockSize": 16}},
     "delete the field"),
    ({"pool": {"deviceClass": "dax", "size": "64Gi"}}, "lower spec.pool.size to at most 16Gi"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi", "nodeSelector": {"rack": "b"}}}, "change spec.pool.nodeSelector"),
    ({"pool": {"deviceClass": "pmem", "size": "1Gi"}}, "use one of dax, shm"),
], ids=["removed-block-size", "too-large", "no-node-matches", "unknown-class"])
def test_bad_spec_is_refused_with_a_fix_and_allocates_nothing(kube: Kube, operator: OperatorThread, spec, fix):
    kube.apply_cache("bad", spec)
    body = wait_for(lambda: (c := kube.cache("bad")) and condition(c, "ConfigValid"), what="ConfigValid")
    body = kube.cache("bad")
    cond = condition(body, "ConfigValid")
    assert cond["status"] == "False" and fix in cond["message"], cond
    assert body["status"]["phase"] == "Invalid" and condition(body, "Ready")["status"] == "False"
    assert wait_for(lambda: [e for e in kube.events() if e.get("type") == "Warning" and fix in e["message"]])
    assert kube.ledger() == []
    assert not [k for k in kube.objects("v1/configmaps") if k[1].startswith("bad-")]
    assert not kube.objects("apps/v1/deployments") and not kube.objects("v1/secrets")


def test_reconciling_the_same_object_twice_changes_nothing(kube: Kube, cluster, options):
    kube.apply_cache("twice", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
    nodes = [parse_node(n) for n in kube.objects("v1/nodes").values()]

    async def go():
        api = KubeApi(load_configuration(options.kubeconfig))
        ledger = LedgerStore(api, "maru-system")
        body = kube.cache("twice")
        first = await reconciler.reconcile(api, ledger, body, nodes, None)
        kube.request("PATCH", "/apis/maru.io/v1alpha1/namespaces/default/marucaches/twice/status",
                     {"status": first.status}, "application/merge-patch+json")
        versions = {(r, k): o["metadata"]["resourceVersion"] for r in ("v1/configmaps", "v1/secrets",
                    "apps/v1/deployments", "v1/services", "maru.io/v1alpha1/marucaches")
                    for k, o in kube.objects(r).items()}
        second = await reconciler.reconcile(api, ledger, kube.cache("twice"), nodes, None)
        after = {(r, k): o["metadata"]["resourceVersion"] for r in ("v1/configmaps", "v1/secrets",
                 "apps/v1/deployments", "v1/services", "maru.io/v1alpha1/marucaches")
                 for k, o in kube.objects(r).items()}
        api.close()
        return first, second, versions, after

    first, second, versions, after = asyncio.run(go())
    assert first.events and not second.events
    assert second.status == first.status
    assert versions == after


def operator_writes(cluster) -> list[tuple[str, str]]:
    """(method, path) of every write the operator (kopf and `k8s.py`) sent; the tests' own use requests."""
    def collect() -> list[tuple[str, str]]:
        return [(r.method.value, r.url.path) for r in cluster.emulator if r.method.value in ("POST", "PATCH", "PUT")
                and not r.headers.get("User-Agent", "").startswith("python-requests")]
    return cluster.call(collect)


def test_caches_created_at_once_cost_one_reconcile_and_a_dozen_writes_each(kube: Kube, operator: OperatorThread,
                                                                          cluster):
    """Many caches at once: each is reconciled once (the resync timer leaves new caches to the create
    handler), kopf never patches against a version it has already replaced (watches start where the
    list ended), two Events each, and about a dozen writes each — no retry storms."""
    n = 24
    for i in range(n):
        kube.apply_cache(f"m{i:02d}", {"pool": {"deviceClass": "dax", "size": "512Mi"}})

    def allocated() -> int:
        return sum((condition(c, "DevicesAllocated") or {}).get("status") == "True"
                   for c in kube.objects("maru.io/v1alpha1/marucaches").values())
    wait_for(lambda: allocated() == n, what=f"{n} caches allocated")
    for i in range(n):
        kube.make_index_available(f"m{i:02d}")
    wait_for(lambda: all(c["status"].get("phase") == "Ready" for c in kube.objects("maru.io/v1alpha1/marucaches").values()),
             what=f"{n} caches Ready")
    reconciles = sum(operator.metrics.registry.get_sample_value("maru_operator_reconciles_total", {"result": r})
                     for r in ("ready", "progressing", "waiting", "invalid", "error"))
    assert reconciles == n
    assert cluster.emulator.stale_json_patches == 0
    assert sorted(e["reason"] for e in kube.events()) == ["Allocated"] * n + ["Created"] * n
    claims = sorted((c["offset"], c["offset"] + c["size"]) for c in kube.ledger())
    assert len(claims) == n and all(a[1] <= b[0] for a, b in zip(claims, claims[1:])), claims
    writes = operator_writes(cluster)
    # Per cache: kopf's finalizer and its annotations, 5 children, status, Ready status, 2 Events,
    # and at most one ledger write (fewer when updates are group-committed). A Ready write racing
    # kopf's own annotation patch may conflict once (409, re-read, written again), never more.
    conflicts = cluster.emulator.conflicts
    ledger = [w for w in writes if "/configmaps" in w[1] and ("marucache-ledger" in w[1] or "maru-system" in w[1])]
    assert conflicts <= n and len(ledger) <= n, (conflicts, len(ledger))
    assert len(writes) - len(ledger) <= 11 * n + 4 + 2 * conflicts, (len(writes), len(ledger), conflicts)


def test_a_lagging_watch_does_not_reconcile_a_new_cache_twice(kube: Kube, cluster, options):
    """A busy API server's watch brings kopf's own patch back late. Kopf waits for it
    (`consistency_timeout`) before it looks at the cache again; were it to look sooner, it would see
    a body without its record of the create handler, and run that handler a second time."""
    cluster.emulator.watch_lag_s = 1.0
    n = 4
    with OperatorThread(options) as op:
        for i in range(n):
            kube.apply_cache(f"lag{i}", {"pool": {"deviceClass": "dax", "size": "512Mi"}})
        wait_for(lambda: all((condition(c, "DevicesAllocated") or {}).get("status") == "True"
                             for c in kube.objects("maru.io/v1alpha1/marucaches").values())
                 and len(kube.objects("maru.io/v1alpha1/marucaches")) == n, what=f"{n} caches allocated")
        time.sleep(3 * cluster.emulator.watch_lag_s)  # every late event has arrived and been handled
        reconciles = sum(op.metrics.registry.get_sample_value("maru_operator_reconciles_total", {"result": r})
                         for r in ("ready", "progressing", "waiting", "invalid", "error"))
    assert reconciles == n


def test_ready_follows_the_index_deployment_without_waiting_for_a_resync(kube: Kube, options):
    """With a resync period far longer than the test, only the watch of the index Deployment can flip
    Ready (both ways), in one status write each and no reconcile."""
    slow = dataclasses.replace(options, resync_seconds=3600)
    with OperatorThread(slow) as op:
        kube.apply_cache("follow", {"pool": {"deviceClass": "dax", "size": "1Gi"}})
        wait_for(lambda: (condition(kube.cache("follow"), "DevicesAllocated") or {}).get("status") == "True",
                 what="allocation")
        kube.make_index_available("follow")
        body = ready(kube, "follow")
        assert condition(body, "IndexAvailable")["reason"] == "Available" and body["status"]["phase"] == "Ready"
        kube.request("PATCH", "/apis/apps/v1/namespaces/default/deployments/follow-maru-index/status",
                     {"status": {"availableReplicas": 0, "readyReplicas": 0}}, "application/merge-patch+json")
        body = wait_for(lambda: (c := kube.cache("follow")) and c["status"]["phase"] == "Starting" and c,
                        what="Ready withdrawn")
        assert condition(body, "Ready")["status"] == "False"
        assert condition(body, "IndexAvailable")["reason"] == "Unavailable"
        reconciles = sum(op.metrics.registry.get_sample_value("maru_operator_reconciles_total", {"result": r})
                         for r in ("ready", "progressing", "waiting", "invalid", "error"))
        assert reconciles == 1
