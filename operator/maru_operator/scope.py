"""Which namespaces the operator serves: every one (cluster-wide), or a fixed list.

A list (`--watch-namespace`) lets the operator run with Roles in those
namespaces instead of cluster-wide rights. kopf then watches each listed
namespace's MaruCaches, index Deployments and pods, and nothing else; the
only cluster-scoped reads left are the nodes (where a pool can be placed).

kopf's scanning is off in that mode: it would list and watch every
namespace (to match glob patterns, which exact names do not need) and every
CRD (to follow resources defined after the start). Without it, kopf serves
the resources the API's discovery lists when it starts, so the operator
waits for the MaruCache resource to be served first (`wait_until_served`).

The region ledger is shared by every cache of the cluster, also those in
namespaces outside the list (another operator's, or left by a cluster-wide
one): their claims and draining regions are never dropped or freed by an
operator that cannot see their caches and pods (`Scope.covers`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Iterable

from . import API_VERSION, PLURAL
from .k8s import ApiError, KubeApi

logger = logging.getLogger(__name__)

# A namespace name is a DNS-1123 label (what the API server accepts).
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class Scope:
    """The namespaces served; empty: every namespace (cluster-wide)."""

    namespaces: tuple[str, ...] = ()

    @property
    def cluster_wide(self) -> bool:
        return not self.namespaces

    def covers(self, namespace: str) -> bool:
        """Whether this operator sees `namespace`'s caches and pods (and may act on what they hold)."""
        return self.cluster_wide or namespace in self.namespaces


def parse_namespaces(values: Iterable[str]) -> tuple[str, ...]:
    """The namespace names of repeated and comma-separated values, in order, each once.

    Raises ValueError naming a value that is not a namespace name (patterns are not accepted:
    the operator watches exactly the namespaces it is given)."""
    names: list[str] = []
    for value in values:
        for name in (part.strip() for part in value.split(",")):
            if not name:
                continue
            if not _NAMESPACE.fullmatch(name):
                raise ValueError(f"{name!r} is not a namespace name (lowercase letters, digits and '-', "
                                 "at most 63 characters, starting and ending with a letter or digit); "
                                 "list exact namespaces, patterns are not supported")
            if name not in names:
                names.append(name)
    return tuple(names)


async def resource_served(api: KubeApi) -> bool:
    """Whether the API's discovery lists the MaruCache resource (its CRD is installed and established)."""
    try:
        found = await api.get(f"/apis/{API_VERSION}") or {}
    except ApiError as exc:
        logger.warning("cannot read the API's discovery of %s: %s", API_VERSION, exc)
        return False
    return any(r.get("name") == PLURAL for r in found.get("resources") or ())


async def wait_until_served(api: KubeApi, retry_seconds: float = 1.0, report_seconds: float = 30.0) -> None:
    """Return once the MaruCache resource is served; say so every `report_seconds` while it is not."""
    reported = float("-inf")
    while not await resource_served(api):
        if time.monotonic() - reported >= report_seconds:
            reported = time.monotonic()
            logger.warning("the API server does not serve %s/%s yet: install the MaruCache CRD "
                           "(crds/marucache.yaml, or the chart with crds.enabled); waiting", API_VERSION, PLURAL)
        await asyncio.sleep(retry_seconds)
