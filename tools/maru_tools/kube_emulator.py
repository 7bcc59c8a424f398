"""Run the operator for real against kmock (tests, benchmark, local trials).

No Kubernetes API server can be installed where the operator is tested, so
kmock — the Kubernetes API mock server from kopf's author — stands in for
it. kmock keeps objects in memory and serves list/watch/get/create/patch/
delete, but, unlike a real API server, it does not version objects. The
`VersionedEmulator` below adds what the operator's correctness depends on:

- `metadata.resourceVersion` on every write, and optimistic concurrency: a
  patch that carries a stale `resourceVersion` gets 409 Conflict, and so
  does the create of an object that exists (kmock would replace it);
- `uid`, `creationTimestamp`, and `generation` bumped on spec changes;
- fault injection (`fail`), to crash a reconcile half-way, and a watch that
  lags (`watch_lag_s`), as a busy API server's does;
- `GET /version` (`server_version`), which kmock does not serve;
- lists that carry a real `resourceVersion`, and watches that start there:
  kmock answers a list with the version "..." and starts a watch by
  replaying every current object, then streams changes from the moment it
  subscribes to its event bus, after the replay has been written. A change
  made while the replay is being sent is lost, and an object the client
  already listed arrives again with its old version (kopf then re-applies
  its finalizer patch against a stale version, gets 422 and waits for an
  event that never comes). Here the snapshot and the subscription are taken
  atomically, and a watch with `resourceVersion=N` replays only objects
  changed after N, as a real API server does;
- routing that costs the same for the ten-thousandth request as for the
  first. kmock picks the reaction for a request by iterating its whole
  request history through each reaction's filters until it finds the
  request itself, so every request costs time proportional to all requests
  served before it: 100 MaruCaches took minutes, most of it spent in the
  mock, serialised on its event loop. A real API server does not slow down
  with the requests it has answered. While a request is being routed, this
  emulator shows the filters that request alone; the history stays complete
  for assertions (`for request in emulator`). Reactions sliced by position
  in the history (`kmock[...][:1]`) are therefore not supported here.

It still has no schema validation, defaulting, garbage collection or
controllers: tests validate resources against the CRD schema themselves and
play the Deployment controller when they need an index to become available.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import itertools
import json
import pathlib
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import dicts as kmock_dicts

from maru_operator import GROUP, KIND, PLURAL, VERSION
from maru_operator.cli import OperatorOptions, run_operator
from maru_operator.metrics import OperatorMetrics

# The request being routed by the current asyncio task (None outside routing).
_routing: contextvars.ContextVar[kmock.Request | None] = contextvars.ContextVar("kmock_routing", default=None)


class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus resourceVersion, uid, generation and conflicts."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self.faults: list[tuple[str, str, int, bool]] = []  # (method, path substring, status, sticky)
        self.writes = 0
        self.conflicts = 0  # writes refused for a stale resourceVersion (409 and 422 below)
        self.stale_json_patches = 0  # of which JSON patches whose `test` of the resourceVersion failed (422)
        # What `GET /version` answers (None: 404, as an API server that hides it).
        self.server_version: dict[str, str] | None = {"major": "1", "minor": "30", "gitVersion": "v1.30.0"}
        self.watch_lag_s = 0.0  # every watch event reaches its watchers this much after the write

    def __iter__(self) -> Iterator[kmock.Request]:
        # kmock matches a request to a reaction with `request in view`, which walks this iterator:
        # during routing only the request itself is visible (constant time per request).
        routed = _routing.get()
        if routed is None:
            yield from super().__iter__()
        else:
            yield routed

    def _matching(self, request: kmock.Request, since: int | None = None) -> list[dict[str, Any]]:
        """Current objects a list or watch `request` covers (changed after version `since`);
        call with kmock's lock held."""
        found = []
        for (resource, namespace, name), obj in self._objects.items():
            if obj.deleted or resource != request.resource or (request.name is not None and name != request.name):
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            version = _version(obj.raw)
            if since is None or version is None or version > since:
                found.append(obj.raw)
        return found

    def _newest_version(self) -> int:
        versions = (_version(obj.last.raw) for obj in self._objects.values() if not obj.empty)
        return max((v for v in versions if v is not None), default=0)

    async def _serve_list(self, request: kmock.Request) -> Any:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            return {"metadata": {"resourceVersion": str(self._newest_version())}, "items": self._matching(request)}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now: the client waits for them before it reads events
        bus = self._buses[request.resource]
        async with self._lock:  # writes publish under this lock: no change falls between snapshot and mark
            mark = await bus.mark()
            replay = self._matching(request, _version({"metadata": {"resourceVersion":
                                                                     request.params.get("resourceVersion")}}))
        try:
            for raw in replay:
                yield {"type": "ADDED", "object": raw}
            async for event in self._lagging(bus.stream(since=mark)):
                meta = (event.get("object") or {}).get("metadata") or {}
                if (request.namespace is None or meta.get("namespace") == request.namespace) and \
                        (request.name is None or meta.get("name") == request.name):
                    yield event
        finally:
            await bus.unmark(mark)

    async def _lagging(self, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """`events`, each held back `watch_lag_s` after it was published (the lag does not add up)."""
        if not self.watch_lag_s:
            async for event in events:
                yield event
            return
        loop = asyncio.get_running_loop()
        held: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()

        async def drain() -> None:
            async for event in events:
                held.put_nowait((loop.time() + self.watch_lag_s, event))
        drainer = asyncio.create_task(drain())
        try:
            while True:
                due, event = await held.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                yield event
        finally:
            drainer.cancel()

    def fail(self, method: str, path_part: str, status: int = 500, sticky: bool = False) -> None:
        """Answer the next (`sticky`: every) `method` request whose path contains `path_part`
        with an error, changing nothing."""
        self.faults.append((method.upper(), path_part, status, sticky))

    async def _handle(self, request: kmock.Request) -> Any:
        _routing.set(request)  # this request's own task (aiohttp runs one per request)
        if request.url.path == "/version":
            if self.server_version is None:
                raise kmock.KubernetesError(status=404, reason="NotFound", message="no version here")
            return aiohttp.web.json_response(dict(self.server_version))
        for fault in list(self.faults):
            if request.method.value == fault[0] and fault[1] in request.url.path:
                if not fault[3]:
                    self.faults.remove(fault)
                raise kmock.KubernetesError(status=fault[2], reason="InjectedFault", message="injected by the test")
        if request.resource is None or request.action not in (kmock.action.CREATE, kmock.action.UPDATE):
            return await super()._handle(request)
        async with self._write_lock:  # check-then-write must be atomic across concurrent requests
            self._stamp(request)
            self.writes += 1
            return await super()._handle(request)

    def _stamp(self, request: kmock.Request) -> None:
        version = str(next(self._versions))
        data = request.data
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:10]}"
            key = (request.resource, request.namespace, meta.get("name"))
            if key in self._objects and not self._objects[key].deleted:  # kmock would overwrite it
                raise kmock.KubernetesError(status=409, reason="AlreadyExists",
                                            message=f"{meta.get('name')} already exists")
            meta.update(resourceVersion=version, uid=str(uuid.uuid4()), generation=1,
                        creationTimestamp="2026-01-01T00:00:00Z")
            return
        key = (request.resource, request.namespace, request.name)
        current = self._objects[key].raw if key in self._objects and not self._objects[key].deleted else None
        if current is None:
            return  # kmock answers 404 itself
        if isinstance(data, dict):
            wanted = (data.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != current["metadata"].get("resourceVersion"):
                self.conflicts += 1
                raise kmock.KubernetesError(status=409, reason="Conflict",
                                            message="the object has been modified; apply your changes to the "
                                                    "latest version and try again")
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = version
            if "spec" in data and request.subresource is None:
                merged = kmock_dicts.merge_patch_dict(current.get("spec") or {}, data["spec"] or {})
                if merged != (current.get("spec") or {}):
                    meta["generation"] = int(current["metadata"].get("generation") or 1) + 1
        elif isinstance(data, list):
            for op in data:
                if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion" and \
                        op.get("value") != current["metadata"].get("resourceVersion"):
                    self.conflicts += 1
                    self.stale_json_patches += 1
                    raise kmock.KubernetesError(status=422, reason="Invalid",
                                                message="the test operation on /metadata/resourceVersion failed")
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})


def _version(raw: dict[str, Any]) -> int | None:
    value = (raw.get("metadata") or {}).get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


class KmockCluster:
    """A `VersionedEmulator` served on 127.0.0.1 from its own thread and event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kmock", daemon=True)
        self._stopped: asyncio.Event | None = None
        self._done: concurrent.futures.Future[None] | None = None
        self.emulator: VersionedEmulator | None = None
        self.url = ""

    def __enter__(self) -> KmockCluster:
        self._thread.start()
        started: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._done = asyncio.run_coroutine_threadsafe(self._serve(started), self.loop)
        self.url = started.result(timeout=30)
        return self

    async def _serve(self, started: concurrent.futures.Future[str]) -> None:
        self._stopped = asyncio.Event()
        async with VersionedEmulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources.load_bundled()
            emulator.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
                kind=KIND, singular="marucache", namespaced=True, subresources={"status"},
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
            self.emulator = emulator
            started.set_result(str(server.url).rstrip("/"))
            await self._stopped.wait()

    def __exit__(self, *exc: object) -> None:
        if self._stopped is not None:
            self.loop.call_soon_threadsafe(self._stopped.set)
        if self._done is not None:
            self._done.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()

    def call(self, fn: Any) -> Any:
        """Run `fn()` on the emulator's loop (its state is not thread-safe)."""
        async def _run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(_run(), self.loop).result(timeout=30)

    def write_kubeconfig(self, path: pathlib.Path) -> pathlib.Path:
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "kmock",
                  "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                  "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
                  "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}]}
        path.write_text(json.dumps(config))
        return path


class OperatorThread:
    """The real operator (`run_operator`) in a thread of its own, stoppable like a pod."""

    def __init__(self, options: OperatorOptions, metrics: OperatorMetrics | None = None) -> None:
        self.options = options
        self.metrics = metrics or OperatorMetrics.create()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="operator", daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        try:
            asyncio.run(run_operator(self.options, stop_flag=self._stop, ready_flag=self._ready,
                                     metrics=self.metrics))
        except BaseException as exc:  # noqa: BLE001 - reported to the test through .error
            self.error = exc
            self._ready.set()

    def __enter__(self) -> OperatorThread:
        self._thread.start()
        if not self._ready.wait(timeout=60) or self.error is not None:
            raise RuntimeError(f"the operator did not start: {self.error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            raise RuntimeError("the operator did not stop within 60 s")


def iter_objects(cluster: KmockCluster, resource: str) -> Iterator[tuple[str | None, str, dict[str, Any]]]:
    """(namespace, name, body) of every live object of `resource` ('v1/configmaps', ...)."""
    def snapshot() -> list[tuple[str | None, str, dict[str, Any]]]:
        assert cluster.emulator is not None
        res = kmock.resource(resource)
        return [(ns, name, json.loads(json.dumps(obj.raw))) for (r, ns, name), obj in cluster.emulator.objects.items()
                if r == res and not obj.deleted]
    yield from cluster.call(snapshot)
