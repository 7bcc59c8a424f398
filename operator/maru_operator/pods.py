"""Pods that opted in but do not run with their cache's current pool (pure).

The webhook sees a pod only when it is created. A pod created while the
operator was down (the webhook fails open) has no sidecar; a pod injected
before its cache was resized or moved has the old region. Neither can be
fixed in place: the pod must be re-created, which for a Deployment is
`kubectl rollout restart`. The operator surfaces such pods through an Event
on each, the gauge `maru_operator_stale_pods` and the cache's `PodsCurrent`
condition, whose message names the command.

Until such pods are gone they still map the old region: the ledger keeps it
draining (`pods_mapping` tells which pods map a draining region) and the
condition says so.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import ANNOTATION_INJECTED, ANNOTATION_PLACEMENT, ANNOTATION_REGION, ANNOTATION_SKIPPED
from .ledger import Drain
from .results import EventType

OLD_PLACEMENT = "old_placement"
NOT_INJECTED = "not_injected"
REASONS = (OLD_PLACEMENT, NOT_INJECTED)
PODS_CURRENT = "PodsCurrent"
_CACHE_NOT_READY = "MaruCache "  # how injection's skips for a missing, invalid or unallocated cache begin
_HASH_SUFFIX = re.compile(r"-[a-z0-9]{5,10}$")  # a ReplicaSet's pod-template-hash suffix


@dataclasses.dataclass(frozen=True)
class PodView:
    """What the operator keeps about one opted-in pod (from its kopf index)."""

    namespace: str
    name: str
    uid: str
    injected: bool
    skip_reason: str  # the webhook's maru.io/injection-skipped, "" when none
    placement: str
    owner_kind: str = ""
    owner_name: str = ""
    terminating: bool = False
    region: str = ""  # the webhook's maru.io/region, "" when none (not injected, or by an older webhook)
    cache: str = ""  # the cache it was injected for (maru.io/injected)
    finished: bool = False  # every container has ended (phase Succeeded or Failed): it maps nothing


def pod_view(body: Mapping[str, Any]) -> PodView:
    meta = body.get("metadata") or {}
    notes = meta.get("annotations") or {}
    owner = next((o for o in meta.get("ownerReferences") or () if o.get("controller")), None) or {}
    return PodView(namespace=str(meta.get("namespace") or "default"), name=str(meta.get("name") or ""),
                   uid=str(meta.get("uid") or ""), injected=ANNOTATION_INJECTED in notes,
                   skip_reason=str(notes.get(ANNOTATION_SKIPPED) or ""),
                   placement=str(notes.get(ANNOTATION_PLACEMENT) or ""),
                   owner_kind=str(owner.get("kind") or ""), owner_name=str(owner.get("name") or ""),
                   terminating=bool(meta.get("deletionTimestamp")),
                   region=str(notes.get(ANNOTATION_REGION) or ""), cache=str(notes.get(ANNOTATION_INJECTED) or ""),
                   finished=(body.get("status") or {}).get("phase") in ("Succeeded", "Failed"))


def pods_mapping(pods: Iterable[PodView], drain: Drain) -> list[PodView]:
    """The pods that may still map `drain`'s region: injected for it (`maru.io/region`), or, injected by
    an older webhook that recorded no region, for the placement its cache left with. A terminating pod
    still runs until it is gone; a finished one maps nothing."""
    text = drain.region.text
    return [pod for pod in sorted(pods, key=lambda p: (p.namespace, p.name)) if not pod.finished and (
        pod.region == text if pod.region else
        pod.injected and bool(drain.placement) and pod.placement == drain.placement
        and (pod.namespace, pod.cache) == (drain.owner.namespace, drain.owner.name))]


def mapped_by(pods: Iterable[PodView], seen: Callable[[str], bool] | None = None) -> Callable[[Drain], bool]:
    """Whether a draining region may still be mapped (`Ledger.settle` frees it otherwise): by one of
    `pods`, or by pods nobody here can see. Pods map only their own namespace's caches, so a region
    left by a cache of a namespace whose pods are not watched (`seen(namespace)` False; None: every
    namespace is) stays draining."""
    pods = list(pods)
    return lambda drain: (seen is not None and not seen(drain.owner.namespace)) or bool(pods_mapping(pods, drain))


def pod_names(pods: list[PodView], shown: int = 5) -> str:
    """`namespace/name` of the first `shown` pods, for a message an operator reads."""
    return ", ".join(f"{p.namespace}/{p.name}" for p in pods[:shown]) + (", ..." if len(pods) > shown else "")


def draining_note(drains: Iterable[tuple[Drain, list[PodView]]]) -> str:
    """What the PodsCurrent condition adds while regions a cache left still drain: (drain, pods mapping it)."""
    parts = [f"{len(pods)} pod(s) still map its old region {d.region.text} ({pod_names(pods)})"
             for d, pods in drains if pods]
    return ("; " + "; ".join(parts) + " (draining: no cache gets it until they are gone)") if parts else ""


def stale_pods(pods: Iterable[PodView], current: str, region: str = "") -> list[tuple[PodView, str]]:
    """Pods to re-create and why: injected for another placement than `current` (unless the pod
    records the current `region`: an older operator's digest also covered the nodes, which a node
    lost or added changes while the pod maps the same memory); or not injected,
    either never seen by the webhook or skipped because the cache was missing, invalid or not yet
    allocated then (it is allocated now: the caller checks). Pods skipped for a reason of their own
    (outside the podSelector, no vLLM container found, ...) are the user's choice, not stale."""
    found = []
    for pod in sorted(pods, key=lambda p: p.name):
        if pod.terminating:
            continue
        if pod.injected and pod.placement != current and not (region and pod.region == region):
            found.append((pod, OLD_PLACEMENT))
        elif not pod.injected and (not pod.skip_reason or pod.skip_reason.startswith(_CACHE_NOT_READY)):
            found.append((pod, NOT_INJECTED))
    return found


def restart_hint(pod: PodView) -> str:
    """The command that re-creates the pod through its controller."""
    if pod.owner_kind == "ReplicaSet":
        return f"kubectl rollout restart deployment/{_HASH_SUFFIX.sub('', pod.owner_name)} -n {pod.namespace}"
    if pod.owner_kind in ("StatefulSet", "DaemonSet"):
        return f"kubectl rollout restart {pod.owner_kind.lower()}/{pod.owner_name} -n {pod.namespace}"
    return f"kubectl delete pod {pod.name} -n {pod.namespace} and create it again"


def why(reason: str) -> str:
    return ("was injected for an earlier pool placement (the cache was resized or moved)" if reason == OLD_PLACEMENT
            else "has no sidecar: it was created while the webhook was not answering or the cache was not "
                 "ready")


def pods_condition(stale: list[tuple[PodView, str]], draining: str = "") -> tuple[bool, str, str]:
    """(ok, reason, message) of the PodsCurrent condition; `draining` is `draining_note`'s text."""
    if not stale and not draining:
        return True, "AllCurrent", "every opted-in pod runs with the current pool"
    if not stale:  # only pods the cache's selector no longer sees (e.g. relabelled) keep its old region
        return False, "StalePods", f"no opted-in pod is stale{draining}"
    hints = sorted({restart_hint(p) for p, _ in stale})
    names = ", ".join(p.name for p, _ in stale[:5]) + (", ..." if len(stale) > 5 else "")
    return False, "StalePods", (f"{len(stale)} pod(s) do not run with the current pool ({names}); "
                                f"re-create them: {'; '.join(hints[:3])}{draining}")


def condition_of(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or () if c.get("type") == kind), None)


def core_event(involved: Mapping[str, Any], kind: EventType, reason: str, message: str, now: str) -> dict[str, Any]:
    """A core/v1 Event about `involved` (an object reference)."""
    namespace = involved.get("namespace") or "default"
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{involved['name']}.{secrets.token_hex(8)}", "namespace": namespace},
            "involvedObject": dict(involved), "type": kind.value, "reason": reason, "message": message, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": "marucache-operator"}, "reportingComponent": "marucache-operator"}


def stale_event(pod: PodView, reason: str, cache: str, now: str) -> dict[str, Any]:
    involved = {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "namespace": pod.namespace, "uid": pod.uid}
    return core_event(involved, EventType.WARNING, "StaleInjection",
                      f"pod {why(reason)} of MaruCache {cache}; re-create it: {restart_hint(pod)}", now)
