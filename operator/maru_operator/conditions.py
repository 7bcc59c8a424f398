"""Observed state -> status conditions and phase (pure).

Condition types: ConfigValid, DevicesAllocated, IndexAvailable, Ready, and
PodsCurrent (written by the pod check, kept by every other write; it never
makes the cache NotReady: a stale pod is the pod's problem, not the cache's).
`lastTransitionTime` changes only when a condition's status changes, so
writing the same observation twice yields the same status (idempotence).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from .index_health import index_state

CONFIG_VALID = "ConfigValid"
DEVICES_ALLOCATED = "DevicesAllocated"
INDEX_AVAILABLE = "IndexAvailable"
READY = "Ready"
ORDER = (READY, CONFIG_VALID, DEVICES_ALLOCATED, INDEX_AVAILABLE)


@dataclasses.dataclass(frozen=True)
class Observation:
    """Everything a reconcile learned; each field is (ok, reason, message) or None when unknown."""

    config: tuple[bool, str, str]
    devices: tuple[bool, str, str] | None = None
    index: tuple[bool, str, str] | None = None


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, state: tuple[bool, str, str] | None, generation: int) -> dict[str, Any]:
    if state is None:
        return {"type": kind, "status": "Unknown", "reason": "Pending",
                "message": "waiting for the earlier conditions", "observedGeneration": generation}
    ok, reason, message = state
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message,
            "observedGeneration": generation}


def build(observation: Observation, generation: int) -> list[dict[str, Any]]:
    """Conditions (without timestamps) in a fixed order."""
    conds = {
        CONFIG_VALID: observation.config,
        DEVICES_ALLOCATED: observation.devices,
        INDEX_AVAILABLE: observation.index,
    }
    states = [s for s in conds.values()]
    if all(s is not None and s[0] for s in states):
        ready = (True, "Ready", "the pool is allocated and its index is serving")
    else:
        first_bad = next((k, s) for k, s in conds.items() if s is None or not s[0])
        ready = (False, f"{first_bad[0]}Not" + ("Known" if first_bad[1] is None else "True"),
                 "waiting for the earlier conditions" if first_bad[1] is None else first_bad[1][2])
    conds[READY] = ready
    return [_condition(kind, conds[kind], generation) for kind in ORDER]


def phase(conditions: Sequence[Mapping[str, Any]]) -> str:
    """A one-word summary for `kubectl get`: Ready, Invalid, Pending or Starting."""
    by_type = {c["type"]: c for c in conditions}
    if by_type[READY]["status"] == "True":
        return "Ready"
    if by_type[CONFIG_VALID]["status"] == "False":
        return "Invalid"
    if by_type[DEVICES_ALLOCATED]["status"] != "True":
        return "Pending"
    return "Starting"


def with_transition_times(new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]] | None,
                          stamp: str) -> list[dict[str, Any]]:
    """Carry `lastTransitionTime` over from `old` where the status did not change."""
    previous = {c.get("type"): c for c in old or ()}
    result = []
    for cond in new:
        before = previous.get(cond["type"])
        kept = before.get("lastTransitionTime") if before is not None and before.get("status") == cond["status"] \
            else None
        result.append({**cond, "lastTransitionTime": kept or stamp})
    return result


def keep_others(new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """`new` followed by the conditions of `old` whose types `new` does not own (PodsCurrent)."""
    owned = {c["type"] for c in new}
    return [dict(c) for c in new] + [dict(c) for c in old or () if c.get("type") not in owned]


def replace_condition(conditions: Sequence[Mapping[str, Any]] | None, kind: str, state: tuple[bool, str, str],
                      generation: int, stamp: str) -> list[dict[str, Any]]:
    """`conditions` with the one of type `kind` set to `state` (appended when absent)."""
    new = with_transition_times([_condition(kind, state, generation)], conditions, stamp)[0]
    result = [dict(c) for c in conditions or () if c.get("type") != kind]
    return result + [new]


def refresh_index(status: Mapping[str, Any], available: bool, generation: int,
                  why: str = "") -> list[dict[str, Any]] | None:
    """Conditions with IndexAvailable (and Ready) re-derived from `available` and `why` (`index_state`).

    For a cache whose spec was fully reconciled at `generation`: no API call
    is needed, only the Deployment's availability changes. None when the
    stored conditions do not cover this generation (a full reconcile is due).
    """
    by_type = {c.get("type"): c for c in status.get("conditions") or ()}
    if status.get("observedGeneration") != generation or any(k not in by_type for k in ORDER):
        return None

    def state(kind: str) -> tuple[bool, str, str]:
        c = by_type[kind]
        return c.get("status") == "True", str(c.get("reason", "")), str(c.get("message", ""))

    index = index_state(available, why)
    observation = Observation(config=state(CONFIG_VALID), devices=state(DEVICES_ALLOCATED), index=index)
    old = list(by_type.values())
    return keep_others(with_transition_times(build(observation, generation), old, now_rfc3339()), old)
