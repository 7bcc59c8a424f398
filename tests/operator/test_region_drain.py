"""A resized cache's old region drains: the real kopf operator against kmock keeps it from every
other cache while an injected pod still maps it, says so, and hands it out once the pod is gone."""

from __future__ import annotations

import json

from kube_helpers import Kube, condition, wait_for
from maru_operator.injection import cache_info, decide
from maru_operator.ledger import Drain, Region
from maru_operator.models import CacheRef
from maru_operator.pods import PodView, draining_note, pods_mapping
from maru_tools.kube_emulator import OperatorThread

GiB = 1 << 30


def allocation(kube: Kube, name: str, ns: str = "default", size: int | None = None) -> dict:
    def current():
        body = kube.cache(name, ns)
        allocs = ((body or {}).get("status") or {}).get("allocations") or []
        return allocs and (size is None or allocs[0]["size"] == size) and allocs[0]
    return wait_for(current, what=f"{ns}/{name} allocated")


def add_injected_pod(kube: Kube, cache: str, name: str) -> dict:
    """A vLLM pod as the webhook admits it: its annotations come from the real injection decision."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "default", "labels": {"maru.io/cache": cache}},
           "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}
    decision = decide(pod, cache, cache_info(kube.cache(cache)))
    assert decision.injected, decision.reason
    pod["metadata"]["annotations"] = decision.patch["metadata"]["annotations"]
    return kube.request("POST", "/api/v1/namespaces/default/pods", pod)


def draining(kube: Kube) -> list[dict]:
    cm = kube.request("GET", "/api/v1/namespaces/maru-system/configmaps/marucache-ledger")
    return json.loads(cm["data"]["ledger.json"]).get("draining", []) if cm else []


def test_a_resized_cache_old_region_is_given_to_no_cache_until_its_last_pod_is_gone(kube: Kube, options):
    with OperatorThread(options):
        kube.apply_cache("mover", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
        old = allocation(kube, "mover")
        assert (old["deviceUUID"], old["offset"]) == ("cxl-a", 0)
        pod = add_injected_pod(kube, "mover", "vllm-0")
        kube.apply_cache("blocker", {"pool": {"deviceClass": "dax", "size": "2Gi"}})  # at 2Gi: no growing in place
        assert allocation(kube, "blocker")["offset"] == 2 * GiB

        kube.patch_cache("mover", {"pool": {"deviceClass": "dax", "size": "4Gi"}})  # moves to [4Gi, 8Gi)
        assert allocation(kube, "mover", size=4 * GiB)["offset"] == 4 * GiB
        # Left of the 16Gi device: [8Gi, 16Gi) and the draining [0, 2Gi).
        kube.apply_cache("big", {"pool": {"deviceClass": "dax", "size": "8Gi"}}, ns="team-b")
        assert allocation(kube, "big", ns="team-b")["offset"] == 8 * GiB
        kube.apply_cache("late", {"pool": {"deviceClass": "dax", "size": "2Gi"}}, ns="team-b")
        waiting = wait_for(lambda: (c := kube.cache("late", "team-b")) and (condition(c, "DevicesAllocated") or {}).get(
            "reason") == "InsufficientCapacity" and c, what="the new cache waiting")
        assert not (waiting.get("status") or {}).get("allocations")
        assert f"drain until no pod maps them: cxl-a/0/{2 * GiB}" in condition(waiting, "DevicesAllocated")["message"]
        assert not any(c["offset"] < 2 * GiB and c["device"] == "cxl-a" and c["name"] != "mover"
                       for c in kube.ledger())

        # Said where an operator looks: an Event, the ledger, the PodsCurrent condition.
        event = wait_for(lambda: kube.events("RegionDraining"), what="RegionDraining event")[0]
        assert f"cxl-a/0/{2 * GiB}" in event["message"] and "1 pod(s) still map it (default/vllm-0)" in event["message"]
        assert [(d["device"], d["offset"], d["size"]) for d in draining(kube)] == [("cxl-a", 0, 2 * GiB)]
        cond = wait_for(lambda: (c := condition(kube.cache("mover"), "PodsCurrent")) and "draining" in c["message"]
                        and c, what="PodsCurrent naming the draining region")
        assert "vllm-0" in cond["message"] and f"still map its old region cxl-a/0/{2 * GiB}" in cond["message"]

        # The pod that maps the old region is re-created elsewhere (here: deleted): the region is released.
        kube.request("DELETE", "/api/v1/namespaces/default/pods/vllm-0")
        late = allocation(kube, "late", ns="team-b")
        assert (late["deviceUUID"], late["offset"], late["size"]) == ("cxl-a", 0, 2 * GiB)
        assert draining(kube) == []
        assert pod["metadata"]["annotations"]["maru.io/region"] == f"cxl-a/0/{2 * GiB}"  # what kept it
        released = wait_for(lambda: kube.events("RegionReleased"), what="RegionReleased event")
        assert released[0]["involvedObject"]["name"] == "mover"
        wait_for(lambda: (condition(kube.cache("mover"), "PodsCurrent") or {}).get("status") == "True",
                 what="PodsCurrent True again")


def test_a_region_left_with_no_pod_on_it_is_free_at_once(kube: Kube, options):
    with OperatorThread(options):
        kube.apply_cache("mover", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
        allocation(kube, "mover")
        kube.apply_cache("blocker", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
        allocation(kube, "blocker")
        kube.patch_cache("mover", {"pool": {"deviceClass": "dax", "size": "4Gi"}})
        allocation(kube, "mover", size=4 * GiB)
        assert draining(kube) == []
        kube.apply_cache("next", {"pool": {"deviceClass": "dax", "size": "2Gi"}}, ns="team-b")
        assert allocation(kube, "next", ns="team-b")["offset"] == 0  # the tightest gap: the old region
        assert not kube.events("RegionDraining")


def test_which_pods_map_a_draining_region():
    drain = Drain(CacheRef("default", "mover", "uid-1"), "dax", Region("cxl-a", 0, 2 * GiB), "digest-old")

    def pod(name, **kw):
        base = dict(namespace="default", name=name, uid=name, injected=True, skip_reason="", placement="",
                    cache="mover")
        return PodView(**{**base, **kw})
    pods = [
        pod("by-region", region=f"cxl-a/0/{2 * GiB}"),
        pod("terminating", region=f"cxl-a/0/{2 * GiB}", terminating=True),  # still runs until gone
        pod("finished", region=f"cxl-a/0/{2 * GiB}", finished=True),  # its containers have ended
        pod("current", region=f"cxl-a/{4 * GiB}/{4 * GiB}", placement="digest-old"),  # region wins
        pod("older-webhook", placement="digest-old"),  # no maru.io/region: the placement it left with
        pod("older-other-cache", placement="digest-old", cache="other"),
        pod("older-other-placement", placement="digest-new"),
        pod("not-injected", injected=False, cache=""),
    ]
    assert [p.name for p in pods_mapping(pods, drain)] == ["by-region", "older-webhook", "terminating"]
    # The condition names them, as the RegionDraining Event does, whichever pass wrote it.
    note = draining_note([(drain, pods_mapping(pods, drain)), (drain, [])])
    assert note == (f"; 3 pod(s) still map its old region cxl-a/0/{2 * GiB} (default/by-region, "
                    "default/older-webhook, default/terminating) (draining: no cache gets it until they are gone)")
    assert draining_note([(drain, [])]) == ""
