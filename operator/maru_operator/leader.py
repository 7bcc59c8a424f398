"""Leader election over a coordination.k8s.io Lease, as Kubernetes' own controllers do it.

One operator replica holds the Lease and reconciles; the others wait. A
holder renews the Lease every `retry_seconds`; a waiting replica takes it
over only when it has seen no renewal for `lease_seconds`, measured on its
own monotonic clock from the moment it saw the Lease change (never by
comparing the holder's timestamps with its own clock, so clock skew between
nodes cannot make two leaders). A holder that cannot renew for
`renew_deadline_seconds` (shorter than `lease_seconds`) gives up leadership
before anyone else may take it. Every write carries the resourceVersion it
was computed from: of two replicas racing for a free Lease, one gets 409.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from .k8s import ApiError, Conflict, KubeApi, object_path

logger = logging.getLogger(__name__)


def _now_micro() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclasses.dataclass
class LeaseElector:
    api: KubeApi
    namespace: str
    name: str
    identity: str
    lease_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0
    clock: Callable[[], float] = time.monotonic
    # What this replica last saw of the Lease (holder, renewTime, resourceVersion), and when.
    _observed: tuple[Any, ...] | None = None
    _observed_at: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError(f"leader election needs 0 < retry ({self.retry_seconds} s) < renew deadline "
                             f"({self.renew_deadline_seconds} s) < lease ({self.lease_seconds} s)")

    @property
    def path(self) -> str:
        return object_path("coordination.k8s.io/v1", "Lease", self.namespace, self.name)

    def _spec(self, transitions: int, acquired: str | None) -> dict[str, Any]:
        now = _now_micro()
        return {"holderIdentity": self.identity, "leaseDurationSeconds": int(round(self.lease_seconds)),
                "acquireTime": acquired or now, "renewTime": now, "leaseTransitions": transitions}

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this replica holds the Lease afterwards."""
        lease = await self.api.get(self.path)
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec(0, None)}
            try:
                await self.api.create(object_path("coordination.k8s.io/v1", "Lease", self.namespace), body)
            except Conflict:
                return False  # another replica created it first
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        seen = (holder, spec.get("renewTime"), (lease.get("metadata") or {}).get("resourceVersion"))
        if seen != self._observed:
            self._observed, self._observed_at = seen, self.clock()
        free = not holder or self.clock() - self._observed_at >= float(spec.get("leaseDurationSeconds")
                                                                        or self.lease_seconds)
        if holder != self.identity and not free:
            return False
        ours = holder == self.identity
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if ours else 1)
        patch = {"metadata": {"resourceVersion": seen[2]},
                 "spec": self._spec(transitions, spec.get("acquireTime") if ours else None)}
        try:
            await self.api.merge_patch(self.path, patch)
        except Conflict:
            return False
        if not ours:
            logger.info("took over the Lease %s/%s from %r", self.namespace, self.name, holder or None)
        return True

    async def attempt(self) -> bool:
        """One try to take or renew the Lease; an API error counts as not holding it."""
        try:
            return await self.try_acquire_or_renew()
        except ApiError as exc:
            logger.warning("cannot read or write the Lease %s/%s: %s", self.namespace, self.name, exc)
            return False

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease."""
        while not await self.attempt():
            await asyncio.sleep(self.retry_seconds)
        logger.info("leading as %s (Lease %s/%s)", self.identity, self.namespace, self.name)

    async def hold(self) -> None:
        """Renew the Lease; return when leadership is lost (another holder, or no renewal within the
        renew deadline), so that the caller stops working before another replica may start."""
        renewed = self.clock()
        while True:
            await asyncio.sleep(self.retry_seconds)
            if await self.attempt():
                renewed = self.clock()
            elif self._observed is not None and self._observed[0] not in ("", self.identity):
                logger.error("lost the Lease %s/%s to %s", self.namespace, self.name, self._observed[0])
                return
            if self.clock() - renewed >= self.renew_deadline_seconds:
                logger.error("could not renew the Lease %s/%s for %.0f s", self.namespace, self.name,
                             self.renew_deadline_seconds)
                return

    async def run(self, acquired: asyncio.Event) -> None:
        """Acquire (then set `acquired`) and hold the Lease; return when leadership is lost."""
        await self.acquire()
        acquired.set()
        await self.hold()

    async def release(self) -> None:
        """Hand the Lease back at a clean stop, so that a waiting replica takes over at once."""
        lease = await self.api.get(self.path)
        spec = (lease or {}).get("spec") or {}
        if lease is None or spec.get("holderIdentity") != self.identity:
            return
        try:
            await self.api.merge_patch(self.path, {"metadata": {"resourceVersion": lease["metadata"].get(
                "resourceVersion")}, "spec": {"holderIdentity": None}})
        except ApiError as exc:
            logger.warning("cannot release the Lease %s/%s: %s", self.namespace, self.name, exc)
