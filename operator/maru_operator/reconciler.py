"""One reconcile of one MaruCache: spec -> region -> children -> status.

Idempotent by construction: the ledger returns an existing claim unchanged,
`KubeApi.ensure` writes a child only when it differs, the token Secret is
created once and never rewritten, and the returned status equals the stored
one when nothing changed — so the same event twice changes nothing.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import desired
from .conditions import Observation, build, keep_others, now_rfc3339, phase, with_transition_times
from .index_health import WAITING_MESSAGE, index_state
from .inventory import Device, NodeInfo, candidate_devices
from .k8s import KubeApi, LedgerStore, object_path
from .injection import placement_from_status
from .ledger import AllocationError, Claim, Drain, Impossible, Ledger, Region
from .models import DEFAULT_IMAGE, CacheRef, CacheSpec, SpecError, parse_cache
from .pods import PodView, mapped_by, pod_names, pods_mapping
from .results import EnsureAction, EventType, ReconcileResult

Event = tuple[EventType, str, str]  # (type, reason, message)


@dataclasses.dataclass
class Outcome:
    status: dict[str, Any]
    events: list[Event]
    result: ReconcileResult


def human_bytes(n: int) -> str:
    for unit, scale in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B" if n < 1024 else f"{n / (1 << 30):.2f}Gi"


def _finish(body: Mapping[str, Any], observation: Observation, extra: Mapping[str, Any],
            events: list[Event], result: ReconcileResult) -> Outcome:
    old = body.get("status") or {}
    generation = int((body.get("metadata") or {}).get("generation") or 1)
    conds = keep_others(with_transition_times(build(observation, generation), old.get("conditions"), now_rfc3339()),
                        old.get("conditions"))
    status = {**{k: v for k, v in old.items() if k in ("used",)}, **extra,
              "phase": phase(conds), "observedGeneration": generation, "conditions": conds}
    return Outcome(status, events, result)


def _invalid(body: Mapping[str, Any], reason: str, message: str,
             result: ReconcileResult = ReconcileResult.INVALID) -> Outcome:
    old = body.get("status") or {}
    # Keep what an earlier valid spec allocated: an edit that went wrong must not drop a live pool.
    kept = {k: old[k] for k in ("allocations", "indexEndpoint", "configMapName", "tokenSecretName") if k in old}
    events: list[Event] = []
    if _condition_message(old, "ConfigValid") != message:
        events.append((EventType.WARNING, reason, message))
    return _finish(body, Observation(config=(False, reason, message)), kept, events, result)


def index_events(status: Mapping[str, Any], index: tuple[bool, str, str]) -> list[Event]:
    """A Warning when the index is unavailable for a reason its Deployment or pod gave that the
    stored IndexAvailable condition does not say yet (once per reason, not per resync)."""
    ok, _, message = index
    if ok or message == WAITING_MESSAGE or _condition_message(status, "IndexAvailable") == message:
        return []
    return [(EventType.WARNING, "IndexUnavailable", message)]


def _condition_message(status: Mapping[str, Any], kind: str) -> str | None:
    return next((c.get("message") for c in status.get("conditions") or () if c.get("type") == kind), None)


def _kept_note(body: Mapping[str, Any]) -> str:
    """What an invalid edit of a placed cache leaves running (`_invalid` keeps its allocation)."""
    allocations = (body.get("status") or {}).get("allocations") or []
    if not allocations:
        return ""
    return (f"; until then the cache keeps serving from its region on {allocations[0].get('deviceClass')} "
            f"device {allocations[0].get('deviceUUID')} with its index running (nothing stored is lost)")


def unsatisfiable_message(spec: CacheSpec, nodes: list[NodeInfo]) -> str:
    pool = spec.pool
    if candidate_devices(nodes, pool.device_class, {}) and not candidate_devices(
            nodes, pool.device_class, pool.node_selector):
        return (f"no node matching spec.pool.nodeSelector {dict(pool.node_selector)} offers a "
                f"{pool.device_class} device; change spec.pool.nodeSelector or label such a node")
    if not candidate_devices(nodes, pool.device_class, pool.node_selector):
        label = "maru.io/cxl=true with the maru.io/dax-devices annotation" if pool.device_class == "dax" \
            else "maru.io/shm=true with the maru.io/shm-size annotation"
        return f"no node offers a {pool.device_class} device; label a node {label} (see docs/operator.md)"
    largest = max(d.size for d in candidate_devices(nodes, pool.device_class, pool.node_selector))
    return (f"spec.pool.size {pool.size_text} is larger than the largest {pool.device_class} device "
            f"on matching nodes ({human_bytes(largest)}); lower spec.pool.size to at most {human_bytes(largest)}")


async def reconcile(api: KubeApi, ledger: LedgerStore, body: Mapping[str, Any], nodes: Iterable[NodeInfo],
                    index_available: int | None, pods: Iterable[PodView] = (), index_why: str = "",
                    default_image: str = DEFAULT_IMAGE, seen: Callable[[str], bool] | None = None) -> Outcome:
    """Bring one MaruCache's region and children in line with its spec.

    `nodes` is the current node inventory; `index_available` the index
    Deployment's available replicas as last seen (None: not seen yet);
    `pods` every opted-in pod of the cluster (which draining regions they
    still map); `index_why` what the index's Deployment and pod say is wrong
    (`index_health`); `default_image` the operator's image for an index the
    cache names none for; `seen` the namespaces whose pods `pods` covers
    (None: every one; `mapped_by`). Returns the status to store and the Events to post; raises
    only on API errors (kopf retries the handler).
    """
    nodes, pods = list(nodes), list(pods)
    try:
        ref, spec = parse_cache(body, default_image)
    except SpecError as exc:
        return _invalid(body, "InvalidSpec", str(exc))
    devices = candidate_devices(nodes, spec.pool.device_class, spec.pool.node_selector)
    if not devices and candidate_devices(nodes, spec.pool.device_class, {}):
        # The selector shuts out every node with a device: a spec error, said before the ledger, which would
        # keep returning an existing claim unchanged. (No such node at all is an outage: the claim waits.)
        return _invalid(body, "Unsatisfiable", unsatisfiable_message(spec, nodes) + _kept_note(body))
    injected = status_placement(ref, body)  # the digest the cache's pods were injected with
    try:
        claim, previous, draining = await ledger.update(
            lambda led: _allocate(led, ref, spec, devices, injected, mapped_by(pods, seen)))
    except Impossible:
        return _invalid(body, "Unsatisfiable", unsatisfiable_message(spec, nodes))
    except AllocationError as exc:
        waiting = f"{exc}; waiting for a region to be released"
        observation = Observation(config=(True, "Valid", "the spec can be served"),
                                  devices=(False, "InsufficientCapacity", waiting))
        warnings: list[Event] = [] if _condition_message(body.get("status") or {}, "DevicesAllocated") == waiting \
            else [(EventType.WARNING, "InsufficientCapacity", waiting)]
        return _finish(body, observation, {}, warnings, ReconcileResult.WAITING)
    events: list[Event] = []
    if previous != claim:
        events.append((EventType.NORMAL, "Allocated", f"region of {human_bytes(claim.region.size)} at offset "
                                              f"{claim.region.offset} of {claim.device_class} device "
                                              f"{claim.region.device_uuid}"))
    left = next((d for d in draining if previous is not None and d.region == previous.region
                 and previous.region != claim.region), None)
    if left is not None:
        events.append((EventType.NORMAL, "RegionDraining", draining_message(left, pods_mapping(pods, left))))
    device = next((d for d in devices if d.uuid == claim.region.device_uuid), None)
    if device is None:
        observation = Observation(config=(True, "Valid", "the spec can be served"),
                                  devices=(False, "DeviceUnavailable",
                                           f"device {claim.region.device_uuid} holding this cache's region is no "
                                           "longer advertised by a matching node"))
        return _finish(body, observation, {}, events, ReconcileResult.WAITING)
    placement = desired.place(ref, claim, device)
    index_nodes = await _index_nodes(api, ref, placement, bool((body.get("status") or {}).get("allocations")))
    events += await _ensure_children(api, ref, spec, placement, index_nodes)
    index_ok = bool(index_available)
    index = index_state(index_ok, index_why)
    events += index_events(body.get("status") or {}, index)
    observation = Observation(
        config=(True, "Valid", "the spec can be served"),
        devices=(True, "Allocated", f"{human_bytes(claim.region.size)} on {claim.device_class} device "
                                    f"{claim.region.device_uuid}, nodes {', '.join(placement.nodes)}"),
        index=index)
    extra = {"allocations": [placement.to_status()], "indexEndpoint": desired.index_url(ref, spec),
             "configMapName": desired.config_map_name(ref.name), "tokenSecretName": desired.secret_name(ref.name)}
    return _finish(body, observation, extra, events,
                   ReconcileResult.READY if index_ok else ReconcileResult.PROGRESSING)


def _allocate(led: Ledger, ref: CacheRef, spec: CacheSpec, devices: list[Device], placement: str,
              mapped: Callable[[Drain], bool]) -> tuple[Ledger, tuple[Claim, Claim | None, tuple[Drain, ...]]]:
    """Free the draining regions no pod maps any more, then allocate; a region this cache
    leaves now drains while a pod maps it. Returns the claim, the one before, and what
    this cache left that still drains."""
    led, _ = led.settle(mapped)
    previous = led.claim_of(ref.uid)
    new, claim = led.allocate(ref, spec.pool.device_class, spec.pool.size, devices, placement)
    new, _ = new.settle(mapped)
    return new, (claim, previous, new.draining_of(ref.uid))


def status_placement(ref: CacheRef, body: Mapping[str, Any]) -> str:
    """The placement digest the cache's pods were injected with (its status's), "" when none."""
    allocations = (body.get("status") or {}).get("allocations") or []
    placement = placement_from_status(ref, allocations[0]) if allocations else None
    return desired.fingerprint(placement) if placement is not None else ""


def nodes_moved(body: Mapping[str, Any], nodes: Iterable[NodeInfo]) -> bool:
    """Whether the nodes that reach a placed cache's region differ from those its status records
    (a node lost, added or relabelled): a reconcile is due even while the cache is Ready, so that
    pods created from now on may use every node that reaches the region."""
    allocations = (body.get("status") or {}).get("allocations") or []
    if not allocations:
        return False
    try:
        ref, spec = parse_cache(body)
    except SpecError:
        return False
    devices = candidate_devices(nodes, spec.pool.device_class, spec.pool.node_selector)
    device = next((d for d in devices if d.uuid == allocations[0].get("deviceUUID")), None)
    if device is None:
        return True
    claim = Claim(ref, spec.pool.device_class, Region(device.uuid, int(allocations[0].get("offset") or 0),
                                                       int(allocations[0].get("size") or 0)))
    return list(desired.place(ref, claim, device).nodes) != list(allocations[0].get("nodes") or ())


def draining_message(drain: Drain, pods: list[PodView]) -> str:
    return (f"old region {drain.region.text} ({human_bytes(drain.region.size)} at offset {drain.region.offset} of "
            f"{drain.device_class} device {drain.region.device_uuid}) draining: {len(pods)} pod(s) still map it "
            f"({pod_names(pods)}); no cache gets it until they are re-created")


async def _index_nodes(api: KubeApi, ref: CacheRef, placement: desired.Placement,
                       placed_before: bool) -> tuple[str, ...]:
    """The nodes the index Deployment keeps its pod to.

    Changing them changes the pod template, and the index (`Recreate`) restarts. So when only the
    nodes that reach an unchanged region moved (a node lost or added), the Deployment keeps the
    nodes it has while one of them still reaches the region: a lost node cannot be scheduled to, and
    vLLM pods get the new node through the status. Only when none of its nodes reaches the region
    any more is the index moved to the current nodes. `placed_before`: the cache has a placement in
    its status (otherwise the Deployment is new and nothing is read).
    """
    if not placed_before:
        return placement.nodes
    deployed = desired.affinity_nodes(await api.get(object_path(
        "apps/v1", "Deployment", ref.namespace, desired.index_name(ref.name))))
    return deployed if set(deployed) & set(placement.nodes) else placement.nodes


async def _ensure_children(api: KubeApi, ref: CacheRef, spec: CacheSpec,
                           placement: desired.Placement, index_nodes: tuple[str, ...]) -> list[Event]:
    """Create or update the children (the index kept to `index_nodes`); one Event per action
    ("Created", "Updated") naming them all, so a new cache costs one Event, not one per child."""
    done: dict[EnsureAction, list[str]] = {EnsureAction.CREATED: [], EnsureAction.UPDATED: []}
    secret = desired.token_secret(ref, secrets.token_urlsafe(32))
    if await api.ensure_once(secret) is EnsureAction.CREATED:
        done[EnsureAction.CREATED].append(f"Secret {secret['metadata']['name']} with the index token")
    for manifest in desired.children(ref, spec, placement, index_nodes):
        action = await api.ensure(manifest)
        if action in done:
            done[action].append(f"{manifest['kind']} {manifest['metadata']['name']}")
    return [(EventType.NORMAL, action.value.capitalize(), ", ".join(names)) for action, names in done.items()
            if names]


async def release(ledger: LedgerStore, uid: str, placement: str = "", pods: Iterable[PodView] = (),
                  seen: Callable[[str], bool] | None = None) -> tuple[Claim | None, Drain | None]:
    """Return a deleted cache's region to the ledger: the claim released, if any, and its
    drain while pods (`pods`: every opted-in pod of the namespaces `seen`) still map it, else None
    (free at once)."""
    mapped = mapped_by(pods, seen)

    def change(led: Ledger) -> tuple[Ledger, tuple[Claim | None, Drain | None]]:
        claim = led.claim_of(uid)
        new, _ = led.retire(uid, placement).settle(mapped)
        return new, (claim, next((d for d in new.draining_of(uid) if claim and d.region == claim.region), None))
    return await ledger.update(change)


def claims_from_status(body: Mapping[str, Any]) -> list[Claim]:
    """The claims a cache's status records (for rebuilding the ledger)."""
    meta = body.get("metadata") or {}
    ref = CacheRef(str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")))
    claims = []
    for raw in (body.get("status") or {}).get("allocations") or ():
        try:
            claims.append(Claim(ref, str(raw.get("deviceClass")),
                                Region(str(raw["deviceUUID"]), int(raw["offset"]), int(raw["size"]))))
        except (KeyError, TypeError, ValueError):
            continue
    return claims
