"""`status.used`: how much of a cache's pool is in use, read from its index's `/metrics`.

The index exports `maru_pool_capacity_bytes` and `maru_pool_bytes{state}`;
used is capacity minus free. The operator reads them over the index
Service's metrics port (the NetworkPolicy leaves it open) at most every
`--usage-seconds`, and writes the result as a quantity (`1.5Gi`) for the
USED column of `kubectl get mcache`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .desired import index_name
from .models import CacheRef, CacheSpec

log = logging.getLogger(__name__)

MetricsUrl = Callable[[CacheRef, CacheSpec], str]
UsageReader = Callable[[CacheRef, CacheSpec], Awaitable[int | None]]
TIMEOUT_S = 2.0


# `--index-metrics-url`: {index} is the index Service's name, {namespace} the cache's, {port} spec.index.metricsPort.
DEFAULT_URL_TEMPLATE = "http://{index}.{namespace}.svc:{port}/metrics"


def url_template(template: str = DEFAULT_URL_TEMPLATE) -> MetricsUrl:
    def url_of(ref: CacheRef, spec: CacheSpec) -> str:
        return template.format(index=index_name(ref.name), namespace=ref.namespace, port=spec.index.metrics_port)
    return url_of


service_metrics_url = url_template()


def used_bytes(text: str) -> int | None:
    """Capacity minus free from an index's metrics text; None when either is missing."""
    capacity = free = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "maru_pool_capacity_bytes":
                capacity = sample.value
            elif sample.name == "maru_pool_bytes" and sample.labels.get("state") == "free":
                free = sample.value
    if capacity is None or free is None:
        return None
    return max(0, int(capacity - free))


def quantity(n: int) -> str:
    """Bytes as a short Kubernetes-style quantity: 0, 512Ki, 1.5Gi."""
    for unit, scale in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value >= 100 or value == int(value) else f"{value:.1f}{unit}"
    return str(n)


def http_reader(url_of: MetricsUrl = service_metrics_url) -> UsageReader:
    """A reader that asks the index's metrics endpoint; None (and a debug log) when it does not answer."""

    async def read(ref: CacheRef, spec: CacheSpec) -> int | None:
        url = url_of(ref, spec)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
                async with session.get(url) as resp:
                    if resp.status != 200:
                        return None
                    return used_bytes(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("usage of %s: %s unreadable (%s)", ref.key, url, exc)
            return None

    return read
