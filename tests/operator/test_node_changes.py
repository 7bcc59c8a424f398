"""Nodes come and go under a placed cache, and a nodeSelector edit leaves no node: the real kopf
operator against kmock re-places without restarting the index or flagging pods stale, and says
clearly what to change when no node matches."""

from __future__ import annotations

import json
import time

from kube_helpers import Kube, condition, wait_for
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
        wait_for(lambda: nodes_of(kube, "keep") == ["rack-a-1"], what="the lost node dropped from the placement")
        kube.add_node("rack-a-3", {"maru.io/cxl": "true", "rack": "a"},
                      {"maru.io/dax-devices": json.dumps([{"path": "/dev/dax0.0", "size": "16Gi", "uuid": "cxl-a"}])})
        wait_for(lambda: nodes_of(kube, "keep") == ["rack-a-1", "rack-a-3"], what="the new node in the placement")
        body = ready(kube, "keep")
        assert "rack-a-3" in condition(body, "DevicesAllocated")["message"]
        time.sleep(10 * options.resync_seconds)  # resyncs enough to flag a stale pod, were one stale
        # The running index and pods are left alone; pods created from now on may use the new node.
        assert json.dumps(kube.objects("apps/v1/deployments")[INDEX]["spec"]["template"], sort_keys=True) == template
        assert not kube.events("StaleInjection")
        assert (condition(kube.cache("keep"), "PodsCurrent") or {}).get("status") in (None, "True")
        assert [(c["device"], c["offset"]) for c in kube.ledger()] == [("cxl-a", 0)]
