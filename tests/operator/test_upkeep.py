"""What the resync timer keeps current, against kmock with the real operator: pods left with an old
pool placement or without the sidecar (Event, gauge, PodsCurrent), and `status.used` read from a real
index's /metrics."""

from __future__ import annotations

import dataclasses


from kube_helpers import Kube, condition, wait_for
from maru_tools.index_process import IndexProcess, free_port
from maru_core.pool import Pool, SlotHeader
from maru_operator import ANNOTATION_INJECTED, ANNOTATION_PLACEMENT, ANNOTATION_SKIPPED
from maru_operator.desired import fingerprint
from maru_operator.injection import placement_from_status
from maru_operator.metrics import OperatorMetrics
from maru_operator.models import CacheRef
from maru_tools.kube_emulator import OperatorThread

RS_OWNER = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llama-5d8f9c7b6", "uid": "rs-1",
             "controller": True}]


def add_pod(kube: Kube, name: str, annotations: dict, owners=None) -> dict:
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"maru.io/cache": "kept"},
                         "annotations": annotations, "ownerReferences": owners or []},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}
    return kube.request("POST", "/api/v1/namespaces/default/pods", body)


def current_placement(kube: Kube, name: str) -> str:
    body = kube.cache(name)
    meta = body["metadata"]
    ref = CacheRef(meta["namespace"], meta["name"], meta["uid"])
    return fingerprint(placement_from_status(ref, body["status"]["allocations"][0]))


def test_stale_and_uninjected_pods_get_an_event_a_gauge_and_a_condition(kube: Kube, options):
    metrics = OperatorMetrics.create()
    with OperatorThread(options, metrics=metrics):
        kube.apply_cache("kept", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
        wait_for(lambda: (kube.cache("kept").get("status") or {}).get("allocations"), what="allocation")
        current = current_placement(kube, "kept")
        add_pod(kube, "fresh", {ANNOTATION_INJECTED: "kept", ANNOTATION_PLACEMENT: current})
        add_pod(kube, "skipped", {ANNOTATION_SKIPPED: "pod does not match spec.podSelector"})
        add_pod(kube, "llama-5d8f9c7b6-x2k9q", {ANNOTATION_INJECTED: "kept", ANNOTATION_PLACEMENT: "0" * 16},
                RS_OWNER)
        add_pod(kube, "missed", {})  # created while the webhook was not answering
        add_pod(kube, "early", {ANNOTATION_SKIPPED: "MaruCache kept has no pool allocated yet (phase Pending)"})
        cond = wait_for(lambda: (c := condition(kube.cache("kept"), "PodsCurrent")) and "3 pod(s)" in c["message"]
                        and c, what="PodsCurrent naming the three pods")
        assert cond["reason"] == "StalePods" and cond["status"] == "False"
        assert "kubectl rollout restart deployment/llama -n default" in cond["message"]
        assert "kubectl delete pod missed -n default" in cond["message"]
        events = wait_for(lambda: len(kube.events("StaleInjection")) == 3 and kube.events("StaleInjection"))
        assert {e["involvedObject"]["name"] for e in events} == {"llama-5d8f9c7b6-x2k9q", "missed", "early"}
        labels = {"namespace": "default", "cache": "kept"}
        assert metrics.registry.get_sample_value("maru_operator_stale_pods", {**labels, "reason": "old_placement"}) == 1
        assert metrics.registry.get_sample_value("maru_operator_stale_pods", {**labels, "reason": "not_injected"}) == 2

        # The documented fix: re-create them (rollout restart). The condition and the gauge clear.
        for name in ("llama-5d8f9c7b6-x2k9q", "missed", "early"):
            kube.request("DELETE", f"/api/v1/namespaces/default/pods/{name}")
        cond = wait_for(lambda: (c := condition(kube.cache("kept"), "PodsCurrent")) and c["status"] == "True"
                        and c, what="PodsCurrent True")
        assert cond["reason"] == "AllCurrent"
        assert metrics.registry.get_sample_value("maru_operator_stale_pods", {**labels, "reason": "old_placement"}) == 0
        assert len(kube.events("StaleInjection")) == 3  # one Event per pod, not one per resync


def test_ready_is_not_decided_by_pods_and_other_writes_keep_the_condition(kube: Kube, options):
    with OperatorThread(options):
        kube.apply_cache("kept", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
        wait_for(lambda: (kube.cache("kept").get("status") or {}).get("allocations"), what="allocation")
        add_pod(kube, "missed", {})
        wait_for(lambda: condition(kube.cache("kept"), "PodsCurrent"), what="PodsCurrent")
        kube.make_index_available("kept")
        body = wait_for(lambda: (b := kube.cache("kept"))["status"].get("phase") == "Ready" and b, what="Ready")
        assert condition(body, "PodsCurrent")["status"] == "False"  # kept by the Ready write
        assert condition(body, "Ready")["status"] == "True"


def test_status_used_follows_the_index_metrics(kube: Kube, options):
    metrics_port = free_port()
    index = IndexProcess(pool_size="64Mi", extra_args=("--metrics-port", str(metrics_port),
                                                       "--metrics-addr", "127.0.0.1"))
    opts = dataclasses.replace(options, usage_seconds=0.2, index_metrics_url="http://127.0.0.1:{port}/metrics")
    with index, OperatorThread(opts):
        kube.apply_cache("used", {"pool": {"deviceClass": "dax", "size": "2Gi"},
                                  "index": {"metricsPort": metrics_port}})
        first = wait_for(lambda: (kube.cache("used").get("status") or {}).get("used"), what="status.used")
        client = index.client()
        try:
            with Pool.attach(index.pool_path) as pool:
                for i in range(8):
                    key = i.to_bytes(16, "little")
                    (slot,) = client.reserve([(key, 1 << 20)])
                    pool.write_slot_header(slot.offset, SlotHeader(key=key, generation=slot.generation,
                                                                   length=1 << 20))
                    assert client.commit([key]) == [True]
        finally:
            client.close()
        later = wait_for(lambda: (u := kube.cache("used")["status"].get("used")).endswith("Mi")
                         and float(u[:-2]) >= 8 and u, what="status.used of the 8 objects stored")
    assert first == "0" and float(later[:-2]) < 16
