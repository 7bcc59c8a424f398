"""Typed MaruCache spec, parsed once from the resource body.

`parse_cache(body)` applies the same defaults as the CRD schema (kmock and
old API servers do not default) and raises `SpecError` naming the field and
what to change. Everything downstream works on these frozen dataclasses,
never on raw dicts.
"""

from __future__ import annotations

import dataclasses
import decimal
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from kubernetes.utils import parse_quantity

from maru_core.connector_config import ConnectorKnobs
from maru_core.storage_format import StorageFormat

KNOWN_DEVICE_CLASSES = ("dax", "shm")
EVICTION_POLICIES = ("lru",)
DEFAULT_IMAGE = "ghcr.io/marucache/marucache:0.1.0"
# The extended resource a DAX device plugin advertises (the chart's optional generic-device-plugin
# names it so); index and sidecar request one unit and the plugin puts the device into the container.
DEFAULT_DEVICE_RESOURCE = "squat.ai/{device}"
#: In `pool.deviceResource`, the allocated device's name (`dax1.0` for `/dev/dax1.0`): one resource
#: per device, so that the device plugin hands a pod the device its cache's region is on.
DEVICE_PLACEHOLDER = "{device}"
# The image's user and group (Dockerfile); the hand-off socket's group, shared with the vLLM container.
DEFAULT_UID = 65532
# Requests equal to limits: a Guaranteed GPU pod stays Guaranteed once the sidecar is injected.
DEFAULT_SIDECAR_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"},
                             "limits": {"cpu": "100m", "memory": "128Mi"}}
MAX_NAME_LENGTH = 52  # "<name>-maru-index" must fit a 63-character DNS label
MIN_POOL_BYTES = 64 * 1024 * 1024
_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


class SpecError(ValueError):
    """A spec that cannot be served. `field` is the dotted path to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    device_class: str
    size: int  # bytes
    size_text: str  # as the user wrote it, for status and events
    node_selector: Mapping[str, str]
    device_resource: str = DEFAULT_DEVICE_RESOURCE


# The one place where a MaruCache's vLLM pods run other settings than the connector's defaults
# (maru_core.connector_config), and why: a MaruCache serves engines under load that share its pool, so a
# hit parks while its KV loads whenever other requests are live (async) and its forward starts once the
# first layers have landed (overlap). A connector configured by hand loads synchronously unless asked:
# its defaults are off. Every other default of spec.storage and spec.load is the connector's own.
OPERATOR_PROFILE: Mapping[str, bool] = {
    "maru_async_load": True,
    "maru_overlap_load_with_compute": True,
}


@dataclasses.dataclass(frozen=True)
class StorageSpec:
    layout: StorageFormat = ConnectorKnobs.maru_format
    chunk_tokens: int = ConnectorKnobs.maru_kv_chunk_tokens


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    async_load: bool = OPERATOR_PROFILE["maru_async_load"]
    park_lone_hits: bool = ConnectorKnobs.maru_park_lone_hits
    overlap_with_compute: bool = OPERATOR_PROFILE["maru_overlap_load_with_compute"]
    release_after_layers: int = ConnectorKnobs.maru_overlap_release_after_layers


@dataclasses.dataclass(frozen=True)
class EvictionSpec:
    policy: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.85


@dataclasses.dataclass(frozen=True)
class Scheduling:
    """Where and how the index pod may run; raw Kubernetes objects, passed through."""

    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    image_pull_secrets: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str = ""
    pod_security_context: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    security_context: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class IndexSpec:
    image: str = DEFAULT_IMAGE
    port: int = 7070
    metrics_port: int = 9090
    resources: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    scheduling: Scheduling = dataclasses.field(default_factory=Scheduling)


@dataclasses.dataclass(frozen=True)
class SidecarSpec:
    image: str = DEFAULT_IMAGE
    metrics_port: int = 9091
    resources: Mapping[str, Any] = dataclasses.field(default_factory=lambda: dict(DEFAULT_SIDECAR_RESOURCES))
    socket_group: int = DEFAULT_UID


@dataclasses.dataclass(frozen=True)
class SelectorRequirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LabelSelector:
    """A Kubernetes label selector; the empty selector matches everything."""

    match_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    match_expressions: tuple[SelectorRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for req in self.match_expressions:
            present = req.key in labels
            ok = {
                "In": present and labels.get(req.key) in req.values,
                "NotIn": not present or labels.get(req.key) not in req.values,
                "Exists": present,
                "DoesNotExist": not present,
            }[req.operator]
            if not ok:
                return False
        return True


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    pool: PoolSpec
    storage: StorageSpec
    load: LoadSpec
    eviction: EvictionSpec
    index: IndexSpec
    sidecar: SidecarSpec
    pod_selector: LabelSelector


@dataclasses.dataclass(frozen=True)
class CacheRef:
    """Identity of one MaruCache; `uid` tells a re-created namesake apart."""

    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def parse_quantity_bytes(value: Any, field: str) -> int:
    """A Kubernetes quantity (`64Gi`, `512M`, `1073741824`) as whole bytes."""
    try:
        amount = parse_quantity(value)
    except (ValueError, TypeError, decimal.InvalidOperation):
        raise SpecError(field, f"{value!r} is not a Kubernetes quantity; write e.g. 64Gi or 512Mi") from None
    if amount != amount.to_integral_value() or amount <= 0:
        raise SpecError(field, f"{value!r} must be a positive whole number of bytes, e.g. 64Gi")
    return int(amount)


def parse_cache(body: Mapping[str, Any], default_image: str = DEFAULT_IMAGE) -> tuple[CacheRef, CacheSpec]:
    """Parse a MaruCache body into its identity and typed spec.

    `default_image` is the operator's (`--default-image`, the chart's image):
    the index and sidecar run it unless the cache names an image of its own,
    so that an upgrade of the operator moves every such cache with it (the
    CRD has no default for them, so none is stored in a cache's spec).

    Raises `SpecError` for anything the operator cannot serve, including
    values the CRD schema would have rejected (the operator must not trust
    that every API server validated the object).
    """
    meta = body.get("metadata") or {}
    ref = CacheRef(namespace=str(meta.get("namespace") or "default"), name=str(meta.get("name") or ""),
                   uid=str(meta.get("uid") or ""))
    if not ref.name or len(ref.name) > MAX_NAME_LENGTH:
        raise SpecError("metadata.name", f"must be 1 to {MAX_NAME_LENGTH} characters; rename the MaruCache")
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError("", "the MaruCache has no spec; add spec.pool.deviceClass and spec.pool.size")
    return ref, CacheSpec(
        pool=_parse_pool(_section(spec, "pool")),
        storage=_parse_storage(_section(spec, "storage")),
        load=_parse_load(_section(spec, "load")),
        eviction=_parse_eviction(_section(spec, "eviction")),
        index=_parse_index(_section(spec, "index"), default_image),
        sidecar=_parse_sidecar(_section(spec, "sidecar"), default_image),
        pod_selector=parse_selector(spec.get("podSelector"), "podSelector"),
    )


def _section(spec: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = spec.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(name, f"must be an object, got {type(value).__name__}")
    return value


_Scalar = TypeVar("_Scalar", bool, int, float)


def _typed(section: Mapping[str, Any], prefix: str, key: str, kind: type[_Scalar], default: _Scalar,
           low: float | None = None, high: float | None = None) -> _Scalar:
    raw: object = section.get(key, default)
    field = f"{prefix}.{key}"
    # bool is an int in Python; a YAML `true` must not pass as a port number.
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        raw = float(raw)
    if not isinstance(raw, kind) or (kind is not bool and isinstance(raw, bool)):
        raise SpecError(field, f"must be a {kind.__name__}, got {raw!r}")
    value: _Scalar = raw
    if low is not None and value < low or high is not None and value > high:
        raise SpecError(field, f"must be between {low} and {high}, got {value!r}")
    return value


def _parse_pool(section: Mapping[str, Any]) -> PoolSpec:
    device_class = section.get("deviceClass")
    if not isinstance(device_class, str) or not device_class:
        raise SpecError("pool.deviceClass", "is required: set it to 'dax' or 'shm'")
    if device_class not in KNOWN_DEVICE_CLASSES:
        raise SpecError("pool.deviceClass",
                        f"unknown device class {device_class!r}; use one of {', '.join(KNOWN_DEVICE_CLASSES)}")
    if "size" not in section:
        raise SpecError("pool.size", "is required, e.g. 64Gi")
    size = parse_quantity_bytes(section["size"], "pool.size")
    if size < MIN_POOL_BYTES:
        raise SpecError("pool.size", f"{section['size']} is below the minimum of 64Mi")
    selector = section.get("nodeSelector") or {}
    if not isinstance(selector, Mapping) or not all(isinstance(v, str) for v in selector.values()):
        raise SpecError("pool.nodeSelector", "must map label names to string values")
    resource = section.get("deviceResource", DEFAULT_DEVICE_RESOURCE)
    example = resource.replace(DEVICE_PLACEHOLDER, "dax0.0", 1) if isinstance(resource, str) else None
    if example is None or DEVICE_PLACEHOLDER in example or not _RESOURCE_NAME.match(example):
        raise SpecError("pool.deviceResource", f"{resource!r} is not an extended resource name; write it as "
                                               "the device plugin advertises it, with {device} for the "
                                               "allocated device's name (squat.ai/{device}: squat.ai/dax1.0 for "
                                               "/dev/dax1.0), or one name for all (squat.ai/dax)")
    return PoolSpec(device_class=device_class, size=size, size_text=str(section["size"]),
                    node_selector=dict(selector), device_resource=resource)


def _parse_storage(section: Mapping[str, Any]) -> StorageSpec:
    defaults = StorageSpec()
    try:
        layout = StorageFormat.parse(section.get("layout", defaults.layout))
    except ValueError:
        raise SpecError("storage.layout", f"{section['layout']!r} is not a layout; use one of "
                                          f"{', '.join(f.value for f in StorageFormat)}") from None
    if "blockSize" in section:
        raise SpecError("storage.blockSize", "was removed: the connector reads vLLM's block size at start and "
                                             "aligns chunkTokens to it; delete the field")
    chunk = _typed(section, "storage", "chunkTokens", int, defaults.chunk_tokens, 1, 1 << 20)
    return StorageSpec(layout=layout, chunk_tokens=chunk)


def _parse_load(section: Mapping[str, Any]) -> LoadSpec:
    defaults = LoadSpec()
    return LoadSpec(
        async_load=_typed(section, "load", "async", bool, defaults.async_load),
        park_lone_hits=_typed(section, "load", "parkLoneHits", bool, defaults.park_lone_hits),
        overlap_with_compute=_typed(section, "load", "overlapWithCompute", bool, defaults.overlap_with_compute),
        release_after_layers=_typed(section, "load", "releaseAfterLayers", int, defaults.release_after_layers,
                                    0, 4096),
    )


def _parse_eviction(section: Mapping[str, Any]) -> EvictionSpec:
    policy = section.get("policy", "lru")
    if policy not in EVICTION_POLICIES:
        raise SpecError("eviction.policy", f"{policy!r} is not supported; use lru")
    high = _typed(section, "eviction", "highWatermark", float, 0.95, 0.05, 1.0)
    low = _typed(section, "eviction", "lowWatermark", float, 0.85, 0.0, 0.99)
    if low >= high:
        raise SpecError("eviction.lowWatermark", f"{low} must be below eviction.highWatermark {high}")
    return EvictionSpec(policy=policy, high_watermark=high, low_watermark=low)


def _parse_index(section: Mapping[str, Any], default_image: str) -> IndexSpec:
    spec = IndexSpec(
        image=_image(section, "index", default_image),
        port=_typed(section, "index", "port", int, 7070, 1, 65535),
        metrics_port=_typed(section, "index", "metricsPort", int, 9090, 1, 65535),
        resources=_resources(section, "index"),
        scheduling=_parse_scheduling(section, "index"),
    )
    if spec.port == spec.metrics_port:
        raise SpecError("index.metricsPort", f"must differ from index.port {spec.port}")
    return spec


def _parse_sidecar(section: Mapping[str, Any], default_image: str) -> SidecarSpec:
    return SidecarSpec(
        image=_image(section, "sidecar", default_image),
        metrics_port=_typed(section, "sidecar", "metricsPort", int, 9091, 1, 65535),
        resources=_resources(section, "sidecar") if "resources" in section else dict(DEFAULT_SIDECAR_RESOURCES),
        socket_group=_typed(section, "sidecar", "socketGroup", int, DEFAULT_UID, 0, 2**31 - 1),
    )


def _parse_scheduling(section: Mapping[str, Any], prefix: str) -> Scheduling:
    def listed(key: str) -> tuple[Mapping[str, Any], ...]:
        value = section.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            raise SpecError(f"{prefix}.{key}", "must be a list of objects")
        return tuple(dict(v) for v in value)

    def mapped(key: str) -> dict[str, Any]:
        value = section.get(key) or {}
        if not isinstance(value, Mapping):
            raise SpecError(f"{prefix}.{key}", "must be an object")
        return dict(value)

    selector = mapped("nodeSelector")
    if not all(isinstance(v, str) for v in selector.values()):
        raise SpecError(f"{prefix}.nodeSelector", "must map label names to string values")
    priority = section.get("priorityClassName") or ""
    if not isinstance(priority, str):
        raise SpecError(f"{prefix}.priorityClassName", "must be the name of a PriorityClass")
    return Scheduling(tolerations=listed("tolerations"), affinity=mapped("affinity"), node_selector=selector,
                      image_pull_secrets=listed("imagePullSecrets"), priority_class_name=priority,
                      pod_security_context=mapped("podSecurityContext"),
                      security_context=mapped("securityContext"))


def _image(section: Mapping[str, Any], prefix: str, default: str) -> str:
    image = section.get("image", default)
    if not isinstance(image, str) or not image.strip():
        raise SpecError(f"{prefix}.image", "must be a container image reference")
    return image


def _resources(section: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    resources = section.get("resources") or {}
    if not isinstance(resources, Mapping) or set(resources) - {"requests", "limits", "claims"}:
        raise SpecError(f"{prefix}.resources", "must be a container resources object (requests, limits)")
    return dict(resources)


_RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def parse_selector(raw: Any, field: str) -> LabelSelector:
    """Parse a `metav1.LabelSelector`; None or {} selects everything."""
    if raw is None:
        return LabelSelector()
    if not isinstance(raw, Mapping):
        raise SpecError(field, "must be a label selector with matchLabels and/or matchExpressions")
    labels = raw.get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not all(isinstance(v, str) for v in labels.values()):
        raise SpecError(f"{field}.matchLabels", "must map label names to string values")
    requirements = []
    for i, expr in enumerate(raw.get("matchExpressions") or []):
        where = f"{field}.matchExpressions[{i}]"
        if not isinstance(expr, Mapping) or not _LABEL_KEY.match(str(expr.get("key", ""))):
            raise SpecError(where, "needs a valid label key")
        if expr.get("operator") not in _SELECTOR_OPERATORS:
            raise SpecError(f"{where}.operator", f"use one of {', '.join(_SELECTOR_OPERATORS)}")
        values = tuple(str(v) for v in expr.get("values") or ())
        if expr["operator"] in ("In", "NotIn") and not values:
            raise SpecError(f"{where}.values", f"{expr['operator']} needs at least one value")
        requirements.append(SelectorRequirement(expr["key"], expr["operator"], values))
    return LabelSelector(match_labels=dict(labels), match_expressions=tuple(requirements))
