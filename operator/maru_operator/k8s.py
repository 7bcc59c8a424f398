"""The only module that calls the Kubernetes API (kopf's own watches aside).

`KubeApi` finds the cluster the way kubectl does (in-cluster service
account, else `KUBECONFIG` / `~/.kube/config`) through the official client's
config loaders, and speaks JSON to the API with merge patches. Blocking
client calls run in worker threads so kopf's event loop keeps going.

`LedgerStore` keeps the region ledger in a ConfigMap and changes it only by
compare-and-swap on `metadata.resourceVersion`: two operators (or two
reconciles) that race for the same bytes cannot both win, and a restarted
operator reads back exactly what was claimed.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

from . import API_VERSION, PLURAL
from .desired import differs
from .results import EnsureAction
from .ledger import Ledger

T = TypeVar("T")
LEDGER_KEY = "ledger.json"
_PLURALS = {"ConfigMap": "configmaps", "Secret": "secrets", "Service": "services", "Deployment": "deployments",
            "NetworkPolicy": "networkpolicies", "Event": "events", "Node": "nodes", "Pod": "pods",
            "MaruCache": PLURAL, "Lease": "leases"}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason


class Conflict(ApiError):
    """409: the object exists already, or its resourceVersion moved on."""


def object_path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None,
                subresource: str | None = None) -> str:
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [root]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(_PLURALS[kind])
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


def load_configuration(kubeconfig: str | None = None, context: str | None = None) -> kubernetes.client.Configuration:
    """In-cluster service account first, then a kubeconfig file, like kubectl."""
    config = kubernetes.client.Configuration()
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
            return config
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=config,
                                       persist_config=False)
    return config


class KubeApi:
    """JSON-in, JSON-out access to the API server."""

    def __init__(self, configuration: kubernetes.client.Configuration) -> None:
        self.configuration = configuration
        self._client = kubernetes.client.ApiClient(configuration)

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, body: Any = None, content_type: str | None = None,
              query: Mapping[str, str] | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        params = self._client.param_serialize(method, path, query_params=list((query or {}).items()) or None,
                                              header_params=headers, body=body, auth_settings=["BearerToken"])
        try:
            response = self._client.call_api(*params, _request_timeout=30)
        except ApiException as exc:
            raise self._error(exc.status or 0, exc.body) from None
        data = response.read()
        if response.status >= 400:
            raise self._error(response.status, data)
        return json.loads(data) if data else None

    @staticmethod
    def _error(status: int, raw: Any) -> ApiError:
        try:
            doc = json.loads(raw)
            reason, message = str(doc.get("reason", "")), str(doc.get("message", ""))
        except (TypeError, ValueError):
            reason, message = "", str(raw)[:500]
        cls = Conflict if status == 409 else ApiError
        return cls(status, reason, message)

    async def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                      query: Mapping[str, str] | None = None) -> Any:
        return await asyncio.to_thread(self._call, method, path, body, content_type, query)

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, path: str) -> list[dict[str, Any]]:
        return list((await self.request("GET", path) or {}).get("items") or [])

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, dict(body))

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, dict(body), content_type="application/merge-patch+json")

    async def ensure(self, manifest: Mapping[str, Any]) -> EnsureAction:
        """Make the object match `manifest`: created, updated or unchanged.

        Create first (the common case costs one call); on a conflict, read and
        patch only when the operator's fields differ.
        """
        meta = manifest["metadata"]
        collection = object_path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
        try:
            await self.create(collection, manifest)
            return EnsureAction.CREATED
        except Conflict:
            pass
        path = f"{collection}/{meta['name']}"
        actual = await self.get(path)
        if actual is None:  # deleted between the two calls: next reconcile creates it
            return EnsureAction.UNCHANGED
        if not differs(manifest, actual):
            return EnsureAction.UNCHANGED
        await self.merge_patch(path, manifest)
        return EnsureAction.UPDATED

    async def ensure_once(self, manifest: Mapping[str, Any]) -> EnsureAction:
        """Create the object unless it exists; never touch an existing one (the index token)."""
        meta = manifest["metadata"]
        try:
            await self.create(object_path(manifest["apiVersion"], manifest["kind"], meta["namespace"]), manifest)
            return EnsureAction.CREATED
        except Conflict:
            return EnsureAction.KEPT

    async def patch_cache_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        await self.merge_patch(object_path(API_VERSION, "MaruCache", namespace, name, "status"),
                               {"status": dict(status)})

    async def list_caches(self, namespaces: Sequence[str] = ()) -> builtins.list[dict[str, Any]]:
        """Every MaruCache of the cluster, or (`namespaces`) of those namespaces only, one list each."""
        if not namespaces:  # `list` here is the method above
            return await self.list(object_path(API_VERSION, "MaruCache"))
        return [cache for ns in namespaces for cache in await self.list(object_path(API_VERSION, "MaruCache", ns))]


class LedgerStore:
    """The region ledger, persisted in one ConfigMap with compare-and-swap writes.

    Within one process, updates are group-committed: a change waits for the
    write in flight, then every change that queued up meanwhile is applied in
    order and stored with one write. Many caches created at once therefore
    cost a few ledger writes, not one round trip each in a queue, and never
    conflict with each other. Across processes the resourceVersion
    precondition decides; the loser re-reads and applies its batch again.
    """

    def __init__(self, api: KubeApi, namespace: str, name: str = "marucache-ledger", max_attempts: int = 20) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.max_attempts = max_attempts
        self._lock = asyncio.Lock()
        self._pending: list[tuple[Callable[[Ledger], tuple[Ledger, Any]], asyncio.Future[Any]]] = []
        self._cached: tuple[Ledger, str | None] | None = None
        self.conflicts = 0  # writes refused because another process changed the ledger first
        self.writes = 0  # writes stored

    @property
    def path(self) -> str:
        return object_path("v1", "ConfigMap", self.namespace, self.name)

    async def read(self) -> tuple[Ledger, str | None]:
        """The stored ledger and its resourceVersion (None: not created yet)."""
        obj = await self.api.get(self.path)
        if obj is None:
            return Ledger(), None
        return Ledger.from_json((obj.get("data") or {}).get(LEDGER_KEY)), obj["metadata"].get("resourceVersion")

    async def update(self, change: Callable[[Ledger], tuple[Ledger, T]]) -> T:
        """Apply a pure `change` atomically; returns its result.

        `change` may run several times (after a conflict) and must not have
        side effects. Exceptions it raises propagate to this caller without
        a write of its change; the changes batched with it are unaffected.
        """
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        entry = (change, done)
        self._pending.append(entry)
        try:
            async with self._lock:
                if not done.done():  # nobody committed it while this caller waited: commit the queue
                    batch, self._pending = self._pending, []
                    try:
                        await self._commit(batch)
                    finally:  # cancelled mid-commit: the others' changes go back to the queue
                        unsettled = [e for e in batch if e is not entry and not e[1].done()]
                        if unsettled:
                            self._cached = None
                            self._pending[:0] = unsettled
        except asyncio.CancelledError:
            if entry in self._pending:
                self._pending.remove(entry)
            raise
        return done.result()

    async def _commit(self, batch: list[tuple[Callable[[Ledger], tuple[Ledger, Any]], asyncio.Future[Any]]]) -> None:
        """Apply `batch` in order and store it with one compare-and-swap write; settle every future."""
        try:
            for attempt in range(self.max_attempts):
                ledger, version = self._cached if self._cached is not None else await self.read()
                new, outcomes = ledger, list[tuple[Any, Exception | None]]()
                for change, _ in batch:
                    try:
                        new, result = change(new)
                        outcomes.append((result, None))
                    except Exception as exc:  # noqa: BLE001 - handed to the caller that asked for this change
                        outcomes.append((None, exc))
                try:
                    if new != ledger or version is None:
                        version = await self._write(new, version)
                        self.writes += 1
                    self._cached = (new, version)
                except Conflict:
                    self.conflicts += 1
                    self._cached = None
                    await asyncio.sleep(random.uniform(0, 0.01 * (attempt + 1)))
                    continue
                for (_, future), (result, error) in zip(batch, outcomes):
                    if not future.done():
                        future.set_exception(error) if error is not None else future.set_result(result)
                return
            raise ApiError(409, "Conflict", f"ledger {self.namespace}/{self.name} kept changing; "
                                            f"gave up after {self.max_attempts} attempts")
        except Exception as exc:  # noqa: BLE001 - an API error fails every change of the batch
            self._cached = None
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)

    async def _write(self, ledger: Ledger, version: str | None) -> str:
        data = {LEDGER_KEY: ledger.to_json()}
        if version is None:
            body = {"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": self.name, "namespace": self.namespace,
                                 "labels": {"app.kubernetes.io/name": "marucache",
                                            "app.kubernetes.io/component": "ledger"}},
                    "data": data}
            created = await self.api.create(object_path("v1", "ConfigMap", self.namespace), body)
            return created["metadata"].get("resourceVersion") or ""
        patched = await self.api.merge_patch(self.path, {"metadata": {"resourceVersion": version}, "data": data})
        return patched["metadata"].get("resourceVersion") or ""

    @property
    def cached(self) -> Ledger | None:
        """The ledger as this process last read or wrote it (None: not known; the next update reads)."""
        return self._cached[0] if self._cached is not None else None

    def forget(self) -> None:
        """Drop the cached copy (the next update re-reads)."""
        self._cached = None
