"""docs/operator.md, "Two Deployments sharing one cache", against the real
operator and its webhook on kmock: the pods of both documented Deployments are
injected for the one cache, and a selector naming only one Deployment's own
label (the shape of the earlier examples) refuses the other's."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import yaml
from kube_helpers import Kube, wait_for
from test_webhook import free_port, review

from maru_operator import ANNOTATION_INJECTED, ANNOTATION_SKIPPED
from maru_operator.injection import SIDECAR_NAME
from maru_tools.kube_emulator import OperatorThread

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "operator.md"


def documented() -> tuple[dict, list[dict]]:
    """The section's MaruCache and Deployments."""
    text = DOC.read_text().split("### Two Deployments sharing one cache\n", 1)[1].split("\n### ", 1)[0]
    docs = list(yaml.safe_load_all(re.search(r"```yaml\n(.*?)```", text, re.S).group(1)))
    (cache,) = [d for d in docs if d["kind"] == "MaruCache"]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    return cache, deployments


def pod_of(deployment: dict) -> dict:
    """A pod of ``deployment`` as its ReplicaSet creates it (no name yet, the template's labels)."""
    meta, template = deployment["metadata"], deployment["spec"]["template"]
    replica_set = f"{meta['name']}-5d8f7c9b6"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": f"{replica_set}-", "namespace": meta["namespace"],
                         "labels": dict(template["metadata"]["labels"]),
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": replica_set,
                                              "uid": f"{replica_set}-uid", "controller": True}]},
            "spec": template["spec"]}  # fmt: skip


def test_both_documented_deployments_are_injected_for_the_one_cache(kube: Kube, options):
    cache, deployments = documented()
    name, namespace = cache["metadata"]["name"], cache["metadata"]["namespace"]
    assert len(deployments) == 2
    selectors = [d["spec"]["selector"]["matchLabels"] for d in deployments]
    assert not set(selectors[0].items()) & set(selectors[1].items()), "Deployment selectors must not overlap"
    spec = {**cache["spec"], "pool": {**cache["spec"]["pool"], "size": "4Gi"}}  # the test nodes' devices are 16Gi
    port = free_port()
    opts = dataclasses.replace(options, webhook=True, webhook_insecure=True, webhook_addr="127.0.0.1",
                               webhook_port=port, native_sidecars="never")
    url = f"http://127.0.0.1:{port}/inject"
    with OperatorThread(opts):
        kube.apply_cache(name, spec, ns=namespace)
        wait_for(lambda: (kube.cache(name, namespace).get("status") or {}).get("allocations"), what="allocation")
        for deployment in deployments:
            pod = pod_of(deployment)
            assert pod["metadata"]["labels"]["maru.io/cache"] == name
            patched = wait_for(lambda: (p := review(url, pod)[1]) and ANNOTATION_INJECTED in p["metadata"].get(
                "annotations", {}) and p, what=f"a pod of {deployment['metadata']['name']} injected")
            assert patched["metadata"]["annotations"][ANNOTATION_INJECTED] == name
            assert [c["name"] for c in patched["spec"]["containers"]] == ["vllm", SIDECAR_NAME]
        # A selector naming the first Deployment's own label shuts the second one out.
        kube.patch_cache(name, {"podSelector": {"matchLabels": selectors[0]}}, ns=namespace)
        second = pod_of(deployments[1])
        refused = wait_for(lambda: (p := review(url, second)[1]) and ANNOTATION_SKIPPED in p["metadata"].get(
            "annotations", {}) and p, what="the second Deployment's pod refused")
        assert refused["metadata"]["annotations"][ANNOTATION_SKIPPED] == \
            f"pod does not match spec.podSelector of MaruCache {name}"
        assert ANNOTATION_INJECTED in review(url, pod_of(deployments[0]))[1]["metadata"]["annotations"]
