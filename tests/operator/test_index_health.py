"""An index that is not available says why: the real kopf operator against kmock copies the index
pod's waiting reason and the Deployment's failing condition into the cache's status and an Event."""

from __future__ import annotations

import time

from kube_helpers import Kube, condition, wait_for
from maru_operator.index_health import pod_problem
from maru_tools.kube_emulator import OperatorThread
from test_node_changes import ready


def test_an_index_that_cannot_pull_its_image_says_so_in_status_and_an_event(kube: Kube, options):
    with OperatorThread(options):
        kube.apply_cache("pull", {"pool": {"deviceClass": "dax", "size": "1Gi"}, "index": {"image": "maru/nope:0"}})
        wait_for(lambda: ("default", "pull-maru-index") in kube.objects("apps/v1/deployments"), what="the index")
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "pull-maru-index-5d9c7-abcde", "namespace": "default",
                            "labels": {"maru.io/index-of": "pull"}},
               "spec": {"containers": [{"name": "index", "image": "maru/nope:0"}]}}
        kube.request("POST", "/api/v1/namespaces/default/pods", pod)
        # The kubelet's report of an image it cannot pull.
        kube.request("PATCH", f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}/status",
                     {"status": {"phase": "Pending", "containerStatuses": [
                         {"name": "index", "ready": False, "image": "maru/nope:0", "state": {"waiting": {
                             "reason": "ImagePullBackOff",
                             "message": 'Back-off pulling image "maru/nope:0"'}}}]}},
                     "application/merge-patch+json")
        body = wait_for(lambda: (c := kube.cache("pull")) and "ImagePullBackOff" in (
            condition(c, "IndexAvailable") or {}).get("message", "") and c, what="the pull error in status")
        message = condition(body, "IndexAvailable")["message"]
        assert 'container index ImagePullBackOff: Back-off pulling image "maru/nope:0"' in message, message
        assert condition(body, "Ready")["message"] == message and body["status"]["phase"] == "Starting"
        event = wait_for(lambda: kube.events("IndexUnavailable"), what="the Event")
        assert event[0]["type"] == "Warning" and "ImagePullBackOff" in event[0]["message"]

        # The ReplicaSet's FailedCreate, as the Deployment controller copies it.
        kube.request("PATCH", "/apis/apps/v1/namespaces/default/deployments/pull-maru-index/status",
                     {"status": {"conditions": [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                                 "message": 'pods "pull-maru-index-5d9c7-" is forbidden: exceeded '
                                                            "quota"}]}}, "application/merge-patch+json")
        body = wait_for(lambda: (c := kube.cache("pull")) and "FailedCreate" in (
            condition(c, "IndexAvailable") or {}).get("message", "") and c, what="FailedCreate in status")
        assert "exceeded quota" in condition(body, "IndexAvailable")["message"]
        wait_for(lambda: [e for e in kube.events("IndexUnavailable") if "FailedCreate" in e["message"]],
                 what="the FailedCreate Event")
        time.sleep(10 * options.resync_seconds)
        assert len(kube.events("IndexUnavailable")) == 2  # once per reason, not once per resync

        kube.make_index_available("pull")
        assert condition(ready(kube, "pull"), "IndexAvailable")["reason"] == "Available"


def test_an_unschedulable_index_pod_says_which_resource_no_node_has_and_a_starting_one_says_nothing():
    unschedulable = {"metadata": {"name": "x-maru-index-1"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient squat.ai/dax."}]}}
    assert pod_problem(unschedulable) == ("index pod x-maru-index-1 Unschedulable: 0/3 nodes are available: "
                                          "3 Insufficient squat.ai/dax.")
    starting = {"metadata": {"name": "x-maru-index-1"}, "status": {"containerStatuses": [
        {"name": "index", "state": {"waiting": {"reason": "ContainerCreating"}}}]}}
    assert pod_problem(starting) == ""
