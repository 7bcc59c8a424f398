"""kopf handlers, registered into an explicit registry (no import-time globals).

Change handlers (create, update of the spec, resume after a restart) and a
resync timer all run the same idempotent `reconciler.reconcile`, serialised
per object. The timer is how a cache that waits (for capacity, for nodes,
for its index Deployment) converges without a new event. Indices keep the
node inventory, index Deployments and caches in memory so a reconcile or an
admission review lists nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import kopf

from . import API_VERSION, GROUP, KIND, LABEL_CACHE, MANAGED_BY, PLURAL, VERSION, reconciler, upkeep
from .conditions import now_rfc3339, phase, refresh_index
from .context import OperatorContext, Written
from .desired import LABEL_INDEX_OF
from .index_health import deployment_problem, index_state, pod_problem
from .injection import cache_info
from .inventory import NodeInfo, parse_node
from .k8s import ApiError, Conflict, KubeApi, object_path
from .ledger import rebuild
from .models import CacheRef
from .pods import PodView, core_event, pod_view, pods_mapping
from .results import EventType, ReconcileResult
from .webhook import refusal_event

logger = logging.getLogger(__name__)


def _nodes(index: Any) -> Iterable[NodeInfo]:
    return list(index.get("nodes", ())) if index is not None else []


def all_pods(index: Any) -> list[PodView]:
    """Every opted-in pod of the `maru_pods` index (any namespace, any cache)."""
    return [pod for key in list(index or ()) for pod in list(index.get(key) or ())] if index is not None else []


def _available(index: Any, namespace: str, name: str) -> int | None:
    store = index.get((namespace, name)) if index is not None else None
    return max(store) if store else None


def index_why(health: tuple[Any, Any] | None, namespace: str, name: str) -> str:
    """What a cache's index Deployment and index pod say is wrong, "" when nothing (`index_health`);
    `health`: the `maru_index_health` and `maru_index_pods` indices."""
    found: list[str] = []
    for index in health or ():
        store = index.get((namespace, name)) if index is not None else None
        found += sorted(p for p in store or () if p and p not in found)
    return "; ".join(found)


async def write_status(ctx: OperatorContext, body: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Write the changed status keys, only while the spec is the one they were computed from.

    The write carries the resourceVersion it was computed against. On a
    conflict the object is re-read: if its generation is unchanged (only
    metadata or status moved on), the status is still right and is written
    again against the fresh version; if the spec changed, nothing is written
    (False) and the newer spec's reconcile will write its own. A phase that is
    written (or found already there) is exported as `maru_cache_ready` and
    `maru_cache_phase`.
    """
    meta = body.get("metadata") or {}
    path = object_path(API_VERSION, KIND, meta.get("namespace"), meta.get("name"), "status")
    current: Mapping[str, Any] = body
    for _ in range(5):
        old = current.get("status") or {}
        changes = {k: v for k, v in new.items() if old.get(k) != v}
        if changes:
            version = (current.get("metadata") or {}).get("resourceVersion")
            try:
                await ctx.api.merge_patch(path, {"metadata": {"resourceVersion": version}, "status": changes})
            except Conflict:
                fresh = await ctx.api.get(path.rsplit("/", 1)[0])
                if fresh is None or (fresh.get("metadata") or {}).get("generation") != meta.get("generation"):
                    return False
                current = fresh
                continue
        if new.get("phase"):  # maru_cache_ready and maru_cache_phase follow the phase this process wrote
            ctx.metrics.record_phase(str(meta.get("namespace")), str(meta.get("name")), str(new["phase"]))
        return True
    logger.warning("status of %s/%s kept changing; recomputing later", meta.get("namespace"), meta.get("name"))
    return False


def snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    """A frozen copy: kopf's body is a live view that may move to a newer version mid-handler,
    and a status must be computed from, and written against, one version."""
    return copy.deepcopy(dict(body))


async def run_reconcile(ctx: OperatorContext, live_body: kopf.Body, maru_nodes: Any, maru_deployments: Any,
                        maru_pods: Any = None, health: tuple[Any, Any] | None = None) -> None:
    body = snapshot(live_body)
    meta = body.get("metadata") or {}
    uid, generation = str(meta.get("uid")), int(meta.get("generation") or 1)
    ctx.last_full[uid] = time.monotonic()
    async with ctx.lock(uid):
        if generation < ctx.generations.get(uid, 0):
            return  # a stale body (a timer may lag behind the watch): never undo a newer spec
        ctx.generations[uid] = generation
        with ctx.metrics.timed():
            try:
                outcome = await reconciler.reconcile(
                    ctx.api, ctx.ledger, body, _nodes(maru_nodes),
                    _available(maru_deployments, str(meta.get("namespace")), str(meta.get("name"))),
                    all_pods(maru_pods), index_why(health, str(meta.get("namespace")), str(meta.get("name"))),
                    default_image=ctx.default_image, seen=ctx.scope.covers)
            except Exception:
                ctx.metrics.count_reconcile(ReconcileResult.ERROR)
                raise
        outcome = _with_current_index(outcome, maru_deployments, meta, generation)
        ctx.metrics.count_reconcile(outcome.result)
        if await write_status(ctx, body, outcome.status):
            ctx.written[uid] = Written(generation, outcome.result, outcome.status,
                                       outcome.result is ReconcileResult.READY)
        else:
            ctx.written.pop(uid, None)
    for kind, reason, message in outcome.events:
        kopf.event(live_body, type=kind.value, reason=reason, message=message)


def _with_current_index(outcome: reconciler.Outcome, maru_deployments: Any, meta: Mapping[str, Any],
                        generation: int) -> reconciler.Outcome:
    """The outcome with the index Deployment as it is now: it often becomes available while its
    cache's first reconcile is still running, and one status write then says Ready."""
    if outcome.result is not ReconcileResult.PROGRESSING or \
            not _available(maru_deployments, str(meta.get("namespace")), str(meta.get("name"))):
        return outcome
    conds = refresh_index(outcome.status, True, generation)
    if conds is None:
        return outcome
    return dataclasses.replace(outcome, status={**outcome.status, "conditions": conds, "phase": phase(conds)},
                               result=ReconcileResult.READY)


async def run_resync(ctx: OperatorContext, live_body: kopf.Body, maru_nodes: Any, maru_deployments: Any,
                     maru_pods: Any = None, health: tuple[Any, Any] | None = None) -> None:
    """The timer's look at a cache: nothing, a status refresh, or a full reconcile.

    A cache whose current generation no change handler (create, update,
    resume) has reconciled yet, or whose reconcile is running, is left to
    that handler: kopf starts timers as soon as it sees an object, and a
    second reconcile of every new cache would double the operator's API
    calls when many are created at once.
    What this process last wrote is kept in memory (`ctx.written`), because
    the body kopf hands a timer may lag behind the operator's own writes.
    """
    body = snapshot(live_body)
    meta = body.get("metadata") or {}
    uid, generation = str(meta.get("uid")), int(meta.get("generation") or 1)
    if meta.get("deletionTimestamp") or ctx.generations.get(uid, 0) < generation or ctx.lock(uid).locked():
        return  # deleted, not yet reconciled by a change handler, or a reconcile is running now
    store = maru_pods.get((meta.get("namespace"), meta.get("name"))) if maru_pods is not None else None
    draining = await upkeep.settle_drains(ctx, body, all_pods(maru_pods))
    await upkeep.check_pods(ctx, body, list(store or ()), write_status, draining)
    await upkeep.refresh_usage(ctx, body, write_status)
    available = _available(maru_deployments, str(meta.get("namespace")), str(meta.get("name")))
    moved = reconciler.nodes_moved(body, _nodes(maru_nodes))  # a node lost or added: re-place
    if _is_settled(body, available) and not moved:
        return
    due = time.monotonic() - ctx.last_full.get(uid, 0.0) >= ctx.full_resync_seconds
    record = ctx.written.get(uid)
    if moved or due or record is None or record.generation != generation or not record.result.served:
        await run_reconcile(ctx, live_body, maru_nodes, maru_deployments, maru_pods, health)
        return
    await refresh_availability(ctx, uid, meta, bool(available), lambda: (meta.get("resourceVersion"), generation),
                               index_why(health, str(meta.get("namespace")), str(meta.get("name"))))


async def refresh_availability(ctx: OperatorContext, uid: str, meta: Mapping[str, Any], available: bool,
                               latest: Callable[[], tuple[str | None, int | None]], why: str = "") -> None:
    """Re-derive IndexAvailable and Ready of a served cache from its index Deployment: one status write,
    no reconcile, and nothing when the availability (and its reason) this process last wrote is the same.

    `meta` names the cache (namespace, name); `latest()` is the newest (resourceVersion, generation)
    of it known when the write is made. The write carries that version, and is made only while that
    generation is the one this process last reconciled (a newer spec gets its own reconcile).
    `why`: what the index's Deployment and pod say is wrong; a new reason is written (and posted as
    an Event) even when the availability is unchanged.
    """
    async with ctx.lock(uid):
        record = ctx.written.get(uid)
        state = index_state(available, why)
        if record is None or not record.result.served or (
                record.available == available and _index_message(record.status) == state[2]):
            return
        version, generation = latest()
        conds = refresh_index(record.status, available, record.generation, why)
        if version is None or generation != record.generation or conds is None:
            return
        status = {**record.status, "conditions": conds, "phase": phase(conds)}
        cache = {"metadata": {"namespace": meta.get("namespace"), "name": meta.get("name"),
                              "resourceVersion": version, "generation": record.generation},
                 "status": record.status}
        if await write_status(ctx, cache, {"conditions": conds, "phase": status["phase"]}):
            result = ReconcileResult.READY if available else ReconcileResult.PROGRESSING
            ctx.written[uid] = Written(record.generation, result, status, available)
            for kind, reason, message in reconciler.index_events(record.status, state):
                involved = {"apiVersion": API_VERSION, "kind": KIND, "name": meta.get("name"),
                            "namespace": meta.get("namespace"), "uid": uid}
                try:
                    await ctx.api.create(object_path("v1", "Event", str(meta.get("namespace"))),
                                         core_event(involved, kind, reason, message, now_rfc3339()))
                except ApiError as exc:
                    logger.warning("cannot post the Event of an unavailable index: %s", exc)


def _index_message(status: Mapping[str, Any]) -> str | None:
    return next((c.get("message") for c in status.get("conditions") or () if c.get("type") == "IndexAvailable"),
                None)


async def follow_index_deployment(ctx: OperatorContext, body: Mapping[str, Any], event_type: str | None,
                                  cache_versions: Any, index_pods: Any = None) -> None:
    """Ready follows an index Deployment's availability at once, not at the next resync.

    `cache_versions` is the `maru_cache_versions` index (cache uid -> newest (resourceVersion,
    generation) seen); `index_pods` the `maru_index_pods` index (what the index pod says is wrong).
    """
    meta = body.get("metadata") or {}
    owner = next((o for o in meta.get("ownerReferences") or () if o.get("kind") == KIND), None)
    name = (meta.get("labels") or {}).get("app.kubernetes.io/instance")
    if owner is None or not name or str(owner.get("uid")) not in ctx.generations:
        return  # not ours, or a cache this process has not reconciled (or has forgotten: deleted)
    uid = str(owner.get("uid"))
    available = event_type != "DELETED" and int((body.get("status") or {}).get("availableReplicas") or 0) > 0

    def latest() -> tuple[str | None, int | None]:
        store = cache_versions.get(uid)
        return next(iter(store), (None, None)) if store else (None, None)
    why = index_why((None, index_pods), str(meta.get("namespace")), name)
    why = "; ".join(p for p in (deployment_problem(body), why) if p)
    await refresh_availability(ctx, uid, {"namespace": meta.get("namespace"), "name": name}, available, latest,
                               why)


def _is_settled(body: Mapping[str, Any], available: int | None) -> bool:
    status = body.get("status") or {}
    generation = (body.get("metadata") or {}).get("generation") or 1
    return status.get("phase") == "Ready" and status.get("observedGeneration") == generation and bool(available)


async def rebuild_ledger_at_start(ctx: OperatorContext) -> None:
    """Reconcile the stored ledger with the caches that exist and the claims their status records
    (in the namespaces served, `ctx.scope`)."""
    before, _version = await ctx.ledger.read()
    bodies = await ctx.api.list_caches(ctx.scope.namespaces)
    live: dict[str, CacheRef] = {}
    recorded = []
    for body in bodies:
        meta = body.get("metadata") or {}
        if meta.get("uid"):
            live[meta["uid"]] = CacheRef(str(meta.get("namespace")), str(meta.get("name")), str(meta["uid"]))
            recorded += reconciler.claims_from_status(body)
    ctx.ledger.forget()
    # Claims of caches in namespaces this operator does not serve are kept: it cannot tell whether
    # those caches exist (`rebuild` keeps every claim it was not given as listed before).
    known = frozenset(c.owner.uid for c in before.claims if ctx.scope.covers(c.owner.namespace))
    problems = await ctx.ledger.update(lambda led: rebuild(led, live, recorded, known))
    for problem in problems:
        logger.warning("ledger rebuild: %s", problem)
    logger.info("ledger rebuilt: %d caches, %d problems", len(live), len(problems))


def build_registry(ctx: OperatorContext) -> kopf.OperatorRegistry:
    """A fresh registry with every handler of the operator."""
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(ctx.api)

    @kopf.on.startup(registry=registry)
    async def rebuild_ledger(**_: Any) -> None:
        await rebuild_ledger_at_start(ctx)
        ctx.native_sidecars = await native_sidecars(ctx.api, ctx.native_mode)
        logger.info("sidecars are injected as %s", "native sidecars (init containers, restartPolicy Always)"
                    if ctx.native_sidecars else "plain containers")

    @kopf.index("", "v1", "pods", id="maru_pods", labels={LABEL_CACHE: kopf.PRESENT}, registry=registry)
    def maru_pods(body: kopf.Body, namespace: str | None, **_: Any) -> dict[tuple[str, str], PodView]:
        return {(str(namespace), str(body.get("metadata", {}).get("labels", {}).get(LABEL_CACHE))): pod_view(body)}

    @kopf.index("", "v1", "nodes", id="maru_nodes", registry=registry)
    def maru_nodes(body: kopf.Body, **_: Any) -> dict[str, NodeInfo]:
        info = parse_node(body)
        for problem in info.problems:
            logger.warning("%s", problem)
        return {"nodes": info} if info.devices else {}

    @kopf.index("apps", "v1", "deployments", id="maru_deployments",
                labels={"app.kubernetes.io/managed-by": MANAGED_BY}, registry=registry)
    def maru_deployments(body: kopf.Body, namespace: str | None, **_: Any) -> dict[tuple[str, str], int]:
        instance = (body.get("metadata") or {}).get("labels", {}).get("app.kubernetes.io/instance")
        return {(str(namespace), instance): int((body.get("status") or {}).get("availableReplicas") or 0)}

    @kopf.index("apps", "v1", "deployments", id="maru_index_health",
                labels={"app.kubernetes.io/managed-by": MANAGED_BY}, registry=registry)
    def maru_index_health(body: kopf.Body, namespace: str | None, **_: Any) -> dict[tuple[str, str], str]:
        instance = (body.get("metadata") or {}).get("labels", {}).get("app.kubernetes.io/instance")
        return {(str(namespace), instance): deployment_problem(body)}

    @kopf.index("", "v1", "pods", id="maru_index_pods", labels={LABEL_INDEX_OF: kopf.PRESENT}, registry=registry)
    def maru_index_pods(body: kopf.Body, namespace: str | None, **_: Any) -> dict[tuple[str, str], str]:
        return {(str(namespace), str(body.get("metadata", {}).get("labels", {}).get(LABEL_INDEX_OF))):
                pod_problem(body)}

    @kopf.index(*resource, id="maru_cache_versions", registry=registry)
    def maru_cache_versions(body: kopf.Body, **_: Any) -> dict[str, tuple[str, int]]:
        meta = body.get("metadata") or {}
        return {str(meta.get("uid")): (str(meta.get("resourceVersion")), int(meta.get("generation") or 1))}

    @kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY},
                   registry=registry)
    async def index_deployment_changed(body: kopf.Body, type: str | None, maru_cache_versions: Any = None,
                                       maru_index_pods: Any = None, **_: Any) -> None:
        await follow_index_deployment(ctx, body, type, maru_cache_versions, maru_index_pods)

    register_cache_index(registry, ctx.default_image)

    # A failed reconcile (an API error) is retried after one resync period, not kopf's default
    # minute: the timer leaves caches to these handlers until they have reconciled once.
    @kopf.on.resume(*resource, backoff=ctx.resync_seconds, registry=registry)
    @kopf.on.create(*resource, backoff=ctx.resync_seconds, registry=registry)
    @kopf.on.update(*resource, field="spec", backoff=ctx.resync_seconds, registry=registry)
    async def reconcile(body: kopf.Body, maru_nodes: Any = None, maru_deployments: Any = None,
                        maru_pods: Any = None, maru_index_health: Any = None, maru_index_pods: Any = None,
                        **_: Any) -> None:
        await run_reconcile(ctx, body, maru_nodes, maru_deployments, maru_pods, (maru_index_health, maru_index_pods))

    @kopf.timer(*resource, interval=ctx.resync_seconds, registry=registry)
    async def resync(body: kopf.Body, maru_nodes: Any = None, maru_deployments: Any = None, maru_pods: Any = None,
                     maru_index_health: Any = None, maru_index_pods: Any = None, **_: Any) -> None:
        await run_resync(ctx, body, maru_nodes, maru_deployments, maru_pods, (maru_index_health, maru_index_pods))

    @kopf.on.delete(*resource, registry=registry)
    async def release(body: kopf.Body, maru_pods: Any = None, **_: Any) -> None:
        meta = body.get("metadata", {})
        uid = str(meta.get("uid"))
        ref = CacheRef(str(meta.get("namespace")), str(meta.get("name")), uid)
        pods = all_pods(maru_pods)  # its region drains while one of them maps it
        async with ctx.lock(uid):
            claim, drain = await reconciler.release(ctx.ledger, uid, reconciler.status_placement(ref, body), pods,
                                                    ctx.scope.covers)
        ctx.forget(uid)
        ctx.metrics.forget_cache(str(meta.get("namespace")), str(meta.get("name")))
        ctx.metrics.count_reconcile(ReconcileResult.RELEASED)
        if drain is not None:
            kopf.event(body, type=EventType.NORMAL.value, reason="RegionDraining",
                       message=reconciler.draining_message(drain, pods_mapping(pods, drain)))
        elif claim is not None:
            kopf.event(body, type=EventType.NORMAL.value, reason="Released",
                       message=f"region of {reconciler.human_bytes(claim.region.size)} at offset "
                               f"{claim.region.offset} of device {claim.region.device_uuid} returned")

    return registry


def register_cache_index(registry: kopf.OperatorRegistry, default_image: str) -> None:
    """The `maru_caches` index the webhook injects from: (namespace, name) -> what injection needs."""
    @kopf.index(GROUP, VERSION, PLURAL, id="maru_caches", registry=registry)
    def maru_caches(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> dict[tuple[str, str], Any]:
        return {(str(namespace), name): cache_info(body, default_image)}


def build_standby_registry(ctx: OperatorContext) -> kopf.OperatorRegistry:
    """The registry of a replica that waits for leadership: only what the webhook reads (the caches'
    index, the sidecar mode). It writes nothing to any object: no change handlers, no timers, no
    finalizers, so kopf keeps no progress annotations that the leader would then miss."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(ctx.api)

    @kopf.on.startup(registry=registry)
    async def sidecar_mode(**_: Any) -> None:
        ctx.native_sidecars = await native_sidecars(ctx.api, ctx.native_mode)

    register_cache_index(registry, ctx.default_image)
    return registry


async def native_sidecars(api: KubeApi, mode: str) -> bool:
    """Whether to inject native sidecars: `always`, `never`, or `auto` (Kubernetes 1.29+, where they
    are on by default)."""
    if mode != "auto":
        return mode == "always"
    try:
        version = await api.get("/version") or {}
        major = int(str(version.get("major", "0")).rstrip("+"))
        minor = int(str(version.get("minor", "0")).rstrip("+"))
    except (ApiError, ValueError) as exc:
        logger.warning("cannot read the API server's version (%s); injecting plain sidecar containers", exc)
        return False
    return (major, minor) >= (1, 29)


async def report_refusal(ctx: OperatorContext, pod: Any, reason: str) -> None:
    """Post the Warning Event of a pod the webhook did not inject (never fails the admission)."""
    event = refusal_event(pod, reason, now_rfc3339())
    if event is None:
        return
    try:
        await ctx.api.create(object_path("v1", "Event", event["metadata"]["namespace"]), event)
    except ApiError as exc:
        logger.warning("cannot post the injection Event: %s", exc)


def connection_info(api: KubeApi) -> kopf.ConnectionInfo:
    """kopf's credentials from the same configuration `KubeApi` uses."""
    config = api.configuration
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        username=config.username or None, password=config.password or None, scheme=scheme, token=token,
        certificate_path=config.cert_file, private_key_path=config.key_file)
