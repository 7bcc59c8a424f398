"""Why an index is not available, in the words of its Deployment and its pod (pure).

The Deployment controller copies a ReplicaSet's `FailedCreate` into the
Deployment's `ReplicaFailure` condition and gives up with `Progressing=False`;
the kubelet reports an image it cannot pull, or a container that keeps
crashing, as the container's waiting reason; the scheduler says why no node
fits (`PodScheduled=False`, e.g. no node with a free device resource). These
texts go into the cache's IndexAvailable (and Ready) condition and an Event.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

WAITING_MESSAGE = "waiting for the index Deployment to become available"
# Waiting reasons of a container that is merely starting: nothing to report.
_STARTING = ("ContainerCreating", "PodInitializing")


def deployment_problem(body: Mapping[str, Any]) -> str:
    """The index Deployment's failing conditions (`ReplicaFailure`, `Progressing=False`), "" when none."""
    found = []
    for cond in (body.get("status") or {}).get("conditions") or ():
        failing = (cond.get("type") == "ReplicaFailure" and cond.get("status") == "True") or (
            cond.get("type") == "Progressing" and cond.get("status") == "False")
        if failing:
            found.append(f"Deployment {cond.get('type')} {cond.get('reason') or ''}: {cond.get('message') or ''}")
    return "; ".join(found)


def pod_problem(body: Mapping[str, Any]) -> str:
    """Why an index pod does not run: unschedulable, or a container waiting (image pull, crash), "" when
    nothing is wrong (or it is merely starting)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    if meta.get("deletionTimestamp"):
        return ""
    name = meta.get("name") or ""
    for cond in status.get("conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"index pod {name} {cond.get('reason') or 'not scheduled'}: {cond.get('message') or ''}"
    for container in list(status.get("initContainerStatuses") or ()) + list(status.get("containerStatuses") or ()):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") and waiting.get("reason") not in _STARTING:
            return (f"index pod {name} container {container.get('name')} {waiting['reason']}"
                    + (f": {waiting['message']}" if waiting.get("message") else ""))
    return ""


def index_state(available: bool, why: str = "") -> tuple[bool, str, str]:
    """(ok, reason, message) of the IndexAvailable condition; `why`: what the Deployment and pod say."""
    if available:
        return True, "Available", "the index Deployment has an available replica"
    return False, "Unavailable", f"{WAITING_MESSAGE}: {why}" if why else WAITING_MESSAGE
