"""Nodes come and go under a placed cache, and a nodeSelector edit leaves no node: the real kopf
operator against kmock re-places without restarting the index or flagging pods stale, and says
clearly what to change when no node matches."""

from __future__ import annotations

import json
import time

from kube_helpers import Kube, condition, wait_for
from maru_operator.injection import cache_info, decide
from maru_operator.pods import PodView, stale_pods
from maru_tools.kube_emulator import OperatorThread
from test_region_drain import add_injected_pod

INDEX = ("default", "keep-maru-index")


def ready(kube: Kube, name: str) -> dict:
    return wait_for(lambda: (c := kube.cache(name)) and (condition(c, "Ready") or {}).get("status") == "True" and c,
                    what=f"{name} Ready")


def nodes_of(kube: Kube, name: str) -> list[str]:
    return (((kube.cache(name) or {}).get("status") or {}).get("allocations") or [{}])[0].get("nodes") or []


def test_a_node_lost_and_a_node_added_move_nothing_a_pod_maps(kube: Kube, options):
    with OperatorThread(options):
        kube.apply_cache("keep", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
        wait_for(lambda: nodes_of(kube, "keep") == ["rack-a-1", "rack-a-2"], what="placed on both nodes")
        kube.make_index_available("keep")
        ready(kube, "keep")
        add_injected_pod(kube, "keep", "vllm-0")
        template = json.dumps(kube.objects("apps/v1/deployments")[INDEX]["spec"]["template"], sort_keys=True)

        kube.request("DELETE", "/api/v1/nodes/rack-a-2")
        # The index ran there: its Deployment is unavailable until its pod is re-created on rack-a-1.
        kube.request("PATCH", "/apis/apps/v1/namespaces/default/deployments/keep-maru-index/status",
                     {"status": {"availableReplicas": 0, "readyReplicas": 0}}, "application/merge-patch+json")
        wait_for(lambda: nodes_of(kube, "keep") == ["rack-a-1"], what="the lost node dropped from the placement")
        kube.make_index_available("keep")
        kube.add_node("rack-a-3", {"maru.io/cxl": "true", "rack": "a"},
                      {"maru.io/dax-devices": json.dumps([{"path": "/dev/dax0.0", "size": "16Gi", "uuid": "cxl-a"}])})
        wait_for(lambda: nodes_of(kube, "keep") == ["rack-a-1", "rack-a-3"], what="the new node in the placement")
        body = ready(kube, "keep")
        assert "rack-a-3" in condition(body, "DevicesAllocated")["message"]
        time.sleep(10 * options.resync_seconds)  # resyncs enough to flag a stale pod, were one stale
        # The running index and pods are left alone; pods created from now on may use the new node.
        pod = {"metadata": {"name": "vllm-1", "namespace": "default", "labels": {"maru.io/cache": "keep"}},
               "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}
        terms = decide(pod, "keep", cache_info(kube.cache("keep"))).patch["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert [f["values"] for f in terms[0]["matchFields"]] == [["rack-a-1", "rack-a-3"]]
        assert json.dumps(kube.objects("apps/v1/deployments")[INDEX]["spec"]["template"], sort_keys=True) == template
        assert not kube.events("StaleInjection")
        assert (condition(kube.cache("keep"), "PodsCurrent") or {}).get("status") in (None, "True")
        assert [(c["device"], c["offset"]) for c in kube.ledger()] == [("cxl-a", 0)]


def test_a_node_selector_edit_that_no_node_matches_is_invalid_and_keeps_the_region(kube: Kube, options):
    with OperatorThread(options):
        kube.apply_cache("keep", {"pool": {"deviceClass": "dax", "size": "2Gi", "nodeSelector": {"rack": "a"}}})
        wait_for(lambda: INDEX in kube.objects("apps/v1/deployments"), what="the index Deployment")
        kube.make_index_available("keep")
        placed = ready(kube, "keep")["status"]["allocations"]
        deployment = kube.objects("apps/v1/deployments")[INDEX]
        claims = kube.ledger()

        kube.patch_cache("keep", {"pool": {"deviceClass": "dax", "size": "2Gi", "nodeSelector": {"rack": "b"}}})
        body = wait_for(lambda: (c := kube.cache("keep")) and c["status"].get("observedGeneration") == 2 and c,
                        what="the edit reconciled")
        cond = condition(body, "ConfigValid")
        assert cond["status"] == "False" and cond["reason"] == "Unsatisfiable", cond
        assert "spec.pool.nodeSelector {'rack': 'b'}" in cond["message"], cond
        assert "change spec.pool.nodeSelector" in cond["message"] and "keeps serving" in cond["message"], cond
        assert body["status"]["phase"] == "Invalid" and condition(body, "Ready")["status"] == "False"
        assert wait_for(lambda: [e for e in kube.events("Unsatisfiable") if e["type"] == "Warning"])
        # Nothing stored is lost: the claim, the placement and the running index are kept.
        assert body["status"]["allocations"] == placed and kube.ledger() == claims
        assert kube.objects("apps/v1/deployments")[INDEX]["metadata"]["resourceVersion"] == \
            deployment["metadata"]["resourceVersion"]

        kube.patch_cache("keep", {"pool": {"deviceClass": "dax", "size": "2Gi", "nodeSelector": {"rack": "a"}}})
        body = ready(kube, "keep")
        assert body["status"]["allocations"] == placed and kube.ledger() == claims


def test_a_pod_an_older_operator_injected_is_current_while_it_records_the_current_region():
    """An older operator's digest also covered the nodes: its pods are judged by their region."""
    older = PodView("default", "vllm-0", "u0", True, "", "digest-with-nodes", region="cxl-a/0/2147483648")
    moved = PodView("default", "vllm-1", "u1", True, "", "digest-with-nodes", region="cxl-a/0/1073741824")
    found = stale_pods([older, moved], "current-digest", "cxl-a/0/2147483648")
    assert [(p.name, reason) for p, reason in found] == [("vllm-1", "old_placement")]
