"""What the resync timer keeps up to date besides the reconcile: stale pods, draining regions and `status.used`.

Both write the cache's status under its lock, only what changed, against the
generation this process last reconciled (`write_status` checks it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import API_VERSION, KIND
from .conditions import now_rfc3339, replace_condition
from .injection import placement_from_status
from .desired import fingerprint
from .k8s import ApiError, object_path
from .models import CacheRef, SpecError, parse_cache
from .ledger import Drain, Ledger, Region
from .pods import (PODS_CURRENT, REASONS, PodView, condition_of, core_event, draining_note, mapped_by,
                   pods_condition, pods_mapping, stale_event, stale_pods)
from .results import EventType
from .usage import quantity

if TYPE_CHECKING:
    from .context import OperatorContext

log = logging.getLogger(__name__)
WriteStatus = Callable[["OperatorContext", Mapping[str, Any], Mapping[str, Any]], Awaitable[bool]]


def _ref(body: Mapping[str, Any]) -> CacheRef:
    meta = body.get("metadata") or {}
    return CacheRef(str(meta.get("namespace") or "default"), str(meta.get("name") or ""), str(meta.get("uid") or ""))


def _base_status(ctx: OperatorContext, uid: str, generation: int, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The newest status this process knows: what it last wrote for this generation, else the body's."""
    record = ctx.written.get(uid)
    return record.status if record is not None and record.generation == generation else body.get("status") or {}


async def _write(ctx: OperatorContext, write: WriteStatus, body: Mapping[str, Any], uid: str, generation: int,
                 changes: Mapping[str, Any]) -> None:
    if await write(ctx, body, changes):
        record = ctx.written.get(uid)
        if record is not None and record.generation == generation:
            ctx.written[uid] = dataclasses.replace(record, status={**record.status, **changes})


async def settle_drains(ctx: OperatorContext, body: Mapping[str, Any], pods: list[PodView]) -> str:
    """Free the draining regions (of any cache) that no pod maps any more, with an Event on the cache
    that left each; return the PodsCurrent note for the regions this cache left that still drain.

    `pods` is every opted-in pod the operator watches (of the cluster, or of `ctx.scope`). Nothing is read or written while the ledger this
    process holds has no draining region.
    """
    known = ctx.ledger.cached
    if known is not None and not known.draining:
        return ""

    def settle(led: Ledger) -> tuple[Ledger, tuple[tuple[Drain, ...], tuple[Drain, ...]]]:
        new, freed = led.settle(mapped_by(pods, ctx.scope.covers))
        return new, (freed, new.draining)
    freed, draining = await ctx.ledger.update(settle)
    for drain in freed:
        owner = drain.owner
        message = f"old region {drain.region.text} released: no pod maps it any more"
        log.info("MaruCache %s/%s: %s", owner.namespace, owner.name, message)
        involved = {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name, "namespace": owner.namespace,
                    "uid": owner.uid}
        try:
            await ctx.api.create(object_path("v1", "Event", owner.namespace),
                                 core_event(involved, EventType.NORMAL, "RegionReleased", message, now_rfc3339()))
        except ApiError as exc:
            log.warning("cannot post the Event of a released region: %s", exc)
    uid = _ref(body).uid
    return draining_note((d, pods_mapping(pods, d)) for d in draining if d.owner.uid == uid)


async def check_pods(ctx: OperatorContext, body: Mapping[str, Any], pods: list[PodView], write: WriteStatus,
                     draining: str = "") -> None:
    """Find the cache's opted-in pods that need re-creating; Event each once, export the gauge, and keep
    the PodsCurrent condition in step (`draining`: `settle_drains`'s note, added to its message)."""
    ref = _ref(body)
    generation = int((body.get("metadata") or {}).get("generation") or 1)
    allocations = (body.get("status") or {}).get("allocations") or []
    placement = placement_from_status(ref, allocations[0]) if allocations else None
    if placement is None:
        return  # nothing injected can be current yet
    current = fingerprint(placement)
    region = Region(placement.device_uuid, placement.offset, placement.size).text
    stale = stale_pods(pods, current, region)
    for reason in REASONS:
        ctx.metrics.stale_pods.labels(namespace=ref.namespace, cache=ref.name, reason=reason).set(
            sum(1 for _, r in stale if r == reason))
    for pod, reason in stale:
        key = f"{pod.uid}:{reason}:{current}"
        if key in ctx.stale_reported:
            continue
        try:
            await ctx.api.create(object_path("v1", "Event", pod.namespace),
                                 stale_event(pod, reason, ref.name, now_rfc3339()))
            ctx.stale_reported.add(key)
        except ApiError as exc:
            log.warning("cannot post the Event of stale pod %s/%s: %s", pod.namespace, pod.name, exc)
    ok, reason, message = pods_condition(stale, draining)
    async with ctx.lock(ref.uid):
        base = _base_status(ctx, ref.uid, generation, body)
        have = condition_of(base, PODS_CURRENT)
        if have is None and ok:
            return  # written from the first stale pod on: a cache that never had one costs no write
        if have is not None and have.get("status") == str(ok) and have.get("message") == message:
            return
        conds = replace_condition(base.get("conditions"), PODS_CURRENT, (ok, reason, message), generation,
                                  now_rfc3339())
        await _write(ctx, write, body, ref.uid, generation, {"conditions": conds})


async def refresh_usage(ctx: OperatorContext, body: Mapping[str, Any], write: WriteStatus) -> None:
    """Write `status.used` from the index's metrics, at most every `ctx.usage_seconds`."""
    ref = _ref(body)
    if ctx.usage_reader is None or not (body.get("status") or {}).get("allocations"):
        return
    now = time.monotonic()
    if now - ctx.last_usage.get(ref.uid, -1e18) < ctx.usage_seconds:
        return
    ctx.last_usage[ref.uid] = now
    try:
        _, spec = parse_cache(body)
    except SpecError:
        return
    used = await ctx.usage_reader(ref, spec)
    if used is None:
        return
    text = quantity(used)
    generation = int((body.get("metadata") or {}).get("generation") or 1)
    async with ctx.lock(ref.uid):
        if _base_status(ctx, ref.uid, generation, body).get("used") == text:
            return
        await _write(ctx, write, body, ref.uid, generation, {"used": text})
