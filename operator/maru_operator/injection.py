"""Sidecar injection into pods that opt in (pure: pod + cache -> merge patch).

A pod opts in with the label `maru.io/cache: <name>`. It gets:
- the `maru-sidecar` container (the only one that mounts the device),
- an `emptyDir` socket volume shared by the sidecar and the vLLM container,
- the index token (the connector presents it to the sidecar),
- `--kv-transfer-config $(MARU_KV_TRANSFER_CONFIG)` on the vLLM container,
  the variable coming from the cache's ConfigMap — unless the user already
  passes `--kv-transfer-config`, which is never overwritten,
- a required node affinity to the nodes that reach the pool.

Injection is idempotent (the `maru.io/injected` annotation marks a done pod)
and fail-open: whenever it cannot inject, the pod is admitted unchanged but
for a `maru.io/injection-skipped` annotation that says why.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from . import ANNOTATION_CONTAINER, ANNOTATION_INJECTED, ANNOTATION_SKIPPED
from .desired import (CONFIG_KEY, SHM_MOUNT, SOCKET_DIR, SOCKET_PATH, TOKEN_DIR, TOKEN_FILE, Placement,
                      config_map_name, index_url, pool_mount, pool_volume, token_volume)
from .models import CacheRef, CacheSpec, SpecError, parse_cache

SIDECAR_NAME = "maru-sidecar"
SOCKET_VOLUME = "maru-socket"
CONFIG_ENV = "MARU_KV_TRANSFER_CONFIG"
ANNOTATION_USER_CONFIG = "maru.io/kv-transfer-config"
_OUR_VOLUMES = (SOCKET_VOLUME, "maru-pool", "maru-token")


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """What injection needs to know about one MaruCache, read from its body."""

    ref: CacheRef
    spec: CacheSpec | None
    placement: Placement | None
    phase: str
    problem: str = ""


def cache_info(body: Mapping[str, Any]) -> CacheInfo:
    meta = body.get("metadata") or {}
    fallback = CacheRef(str(meta.get("namespace") or "default"), str(meta.get("name") or ""), str(meta.get("uid") or ""))
    status = body.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    try:
        ref, spec = parse_cache(body)
    except SpecError as exc:
        return CacheInfo(fallback, None, None, phase, str(exc))
    allocations = status.get("allocations") or []
    placement = _placement_from_status(ref, spec, allocations[0]) if allocations else None
    return CacheInfo(ref, spec, placement, phase)


def _placement_from_status(ref: CacheRef, spec: CacheSpec, raw: Mapping[str, Any]) -> Placement | None:
    nodes = tuple(raw.get("nodes") or ())
    paths = raw.get("paths") or {}
    if not nodes or not paths:
        return None
    host_path = str(paths[nodes[0]])
    size = int(raw["size"])
    pool_path = (f"{SHM_MOUNT}/{ref.namespace}.{ref.name}.{size}.pool" if raw.get("deviceClass") == "shm"
                 else host_path)
    return Placement(str(raw.get("deviceClass")), str(raw["deviceUUID"]), host_path, int(raw["offset"]), size,
                     nodes, pool_path)


@dataclasses.dataclass(frozen=True)
class Decision:
    """A merge patch for the pod and whether it injects (False: skipped or already done)."""

    patch: dict[str, Any]
    injected: bool
    reason: str


def skip(reason: str) -> Decision:
    return Decision({"metadata": {"annotations": {ANNOTATION_SKIPPED: reason}}}, False, reason)


def decide(pod: Mapping[str, Any], cache_name: str, info: CacheInfo | None) -> Decision:
    """Plan the mutation of `pod` for the cache it names."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if ANNOTATION_INJECTED in annotations:
        return Decision({}, False, "already injected")
    namespace = meta.get("namespace") or "default"
    if info is None:
        return skip(f"MaruCache {cache_name} not found in namespace {namespace}")
    if info.spec is None:
        return skip(f"MaruCache {cache_name} is invalid: {info.problem}")
    if info.placement is None:
        return skip(f"MaruCache {cache_name} has no pool allocated yet (phase {info.phase})")
    if not info.spec.pod_selector.matches(meta.get("labels") or {}):
        return skip(f"pod does not match spec.podSelector of MaruCache {cache_name}")
    spec = pod.get("spec") or {}
    containers = list(spec.get("containers") or [])
    target = annotations.get(ANNOTATION_CONTAINER) or (containers[0].get("name") if containers else None)
    index = next((i for i, c in enumerate(containers) if c.get("name") == target), None)
    if index is None:
        return skip(f"container {target!r} named by {ANNOTATION_CONTAINER} is not in the pod")
    clash = _name_clash(containers, spec.get("volumes") or [])
    if clash:
        return skip(clash)
    return _inject(pod, containers, index, info)


def _name_clash(containers: Sequence[Mapping[str, Any]], volumes: Sequence[Mapping[str, Any]]) -> str:
    if any(c.get("name") == SIDECAR_NAME for c in containers):
        return f"the pod already has a container named {SIDECAR_NAME}"
    taken = sorted({v.get("name") for v in volumes} & set(_OUR_VOLUMES))
    return f"the pod already has volumes named {', '.join(taken)}" if taken else ""


def _inject(pod: Mapping[str, Any], containers: list[dict[str, Any]], index: int, info: CacheInfo) -> Decision:
    assert info.spec is not None and info.placement is not None  # checked by decide()
    spec = pod.get("spec") or {}
    vllm = copy.deepcopy(containers[index])
    user_config = _has_user_config(vllm)
    vllm["volumeMounts"] = list(vllm.get("volumeMounts") or []) + [
        {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR},
        {"name": "maru-token", "mountPath": TOKEN_DIR, "readOnly": True}]
    if not user_config:
        vllm["env"] = list(vllm.get("env") or []) + [
            {"name": CONFIG_ENV, "valueFrom": {"configMapKeyRef": {"name": config_map_name(info.ref.name),
                                                                    "key": CONFIG_KEY}}}]
        vllm["args"] = list(vllm.get("args") or []) + ["--kv-transfer-config", f"$({CONFIG_ENV})"]
    containers = containers[:index] + [vllm] + containers[index + 1:] + [sidecar_container(info)]
    volumes = list(spec.get("volumes") or []) + [
        {"name": SOCKET_VOLUME, "emptyDir": {}}, pool_volume(info.placement), token_volume(info.ref)]
    notes = {ANNOTATION_INJECTED: info.ref.name, ANNOTATION_SKIPPED: None}
    if user_config:
        notes[ANNOTATION_USER_CONFIG] = "user-provided: left unchanged"
    patch = {"metadata": {"annotations": notes},
             "spec": {"containers": containers, "volumes": volumes,
                      "affinity": with_node_affinity(spec.get("affinity"), info.placement.nodes)}}
    return Decision(patch, True, "injected")


def _has_user_config(container: Mapping[str, Any]) -> bool:
    words = list(container.get("command") or []) + list(container.get("args") or [])
    return any(w == "--kv-transfer-config" or str(w).startswith("--kv-transfer-config=") for w in words)


def sidecar_container(info: CacheInfo) -> dict[str, Any]:
    assert info.spec is not None and info.placement is not None
    spec, placement = info.spec, info.placement
    command = ["marucache", "sidecar", "--pool", placement.pool_path]
    if placement.offset:
        command += ["--pool-offset", str(placement.offset)]
    command += ["--socket", SOCKET_PATH, "--index", index_url(info.ref, spec), "--token-file", TOKEN_FILE,
                "--metrics-port", str(spec.sidecar.metrics_port), "--cache", info.ref.name]
    return {
        "name": SIDECAR_NAME,
        "image": spec.sidecar.image,
        "command": command,
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": [{"name": "maru-metrics", "containerPort": spec.sidecar.metrics_port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": spec.sidecar.metrics_port}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": spec.sidecar.metrics_port}, "periodSeconds": 10},
        "resources": dict(spec.sidecar.resources),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR}, pool_mount(placement),
                         {"name": "maru-token", "mountPath": TOKEN_DIR, "readOnly": True}],
    }


def with_node_affinity(affinity: Mapping[str, Any] | None, nodes: Sequence[str]) -> dict[str, Any]:
    """AND the pool's nodes into every required node-selector term the pod has."""
    result = copy.deepcopy(dict(affinity or {}))
    ours = {"key": "metadata.name", "operator": "In", "values": list(nodes)}
    node_affinity = result.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [{**t, "matchFields": list(t.get("matchFields") or []) + [ours]} for t in terms]
    return result
