"""Sidecar injection into pods that opt in (pure: pod + cache -> merge patch).

A pod opts in with the label `maru.io/cache: <name>`. It gets:
- the `maru-sidecar` container (the only one that touches the pool device),
  as a native sidecar (an init container with `restartPolicy: Always`) where
  the cluster supports it (Kubernetes 1.29+), else as a plain container;
- an `emptyDir` socket volume shared by the sidecar and the vLLM container,
  and the hand-off socket's group as a supplemental group of the pod, so a
  vLLM container of any user may connect to the 0660 socket;
- the cache token (the index's shared secret), mounted in the sidecar only:
  the sidecar mints its pod's own credential from it
  (`maru_core.pod_credentials`, `--credential-file`) and writes it into the
  socket volume, where the connector reads it and presents it to the sidecar
  and the index in place of the token. The vLLM container does not see the
  cache token, so it cannot mint another pod's credential, and the index
  tells the pod apart from others behind its address;
- `--kv-transfer-config $(MARU_KV_TRANSFER_CONFIG)` on the vLLM container,
  the variable coming from the cache's ConfigMap (the config naming the
  credential) — unless the user already passes `--kv-transfer-config`, which
  is never overwritten: their config may name the cache token's file, so
  that vLLM container keeps the token mounted;
- a required node affinity to the nodes that reach the pool.

The vLLM container is the one the annotation `maru.io/container` names, else
the one that runs vLLM (its name, image, command or arguments say `vllm`),
else the only container. A container that runs a shell script (`sh -c ...`)
cannot take appended arguments: it is injected only when its script already
passes `--kv-transfer-config "$MARU_KV_TRANSFER_CONFIG"`.

Injection is idempotent (the `maru.io/injected` annotation marks a done pod)
and fail-open: whenever it cannot inject, the pod is admitted unchanged but
for a `maru.io/injection-skipped` annotation that says why (and the webhook
posts an Event). Injected pods record their pool's placement
(`maru.io/placement`), which tells pods left on an old region after a resize
or move (see `pods`), and the region itself (`maru.io/region`), which keeps
that region draining in the ledger until they are gone.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from . import (ANNOTATION_CONTAINER, ANNOTATION_INJECTED, ANNOTATION_PLACEMENT, ANNOTATION_REGION,
               ANNOTATION_SKIPPED)
from .desired import (CONTAINER_SECURITY, CREDENTIAL_CONFIG_KEY, CREDENTIAL_FILE, SHM_MOUNT, SOCKET_DIR, SOCKET_PATH,
                      TMP_MOUNT, TMP_VOLUME, TOKEN_FILE, TOKEN_MOUNT, Placement, config_map_name, fingerprint,
                      index_url, pool_mount, pool_volume, token_volume, with_device, with_node_affinity)
from .ledger import Region
from .models import DEFAULT_IMAGE, DEFAULT_UID, CacheRef, CacheSpec, SpecError, parse_cache

SIDECAR_NAME = "maru-sidecar"
SOCKET_VOLUME = "maru-socket"
CONFIG_ENV = "MARU_KV_TRANSFER_CONFIG"
CONFIG_FLAG = "--kv-transfer-config"
ANNOTATION_USER_CONFIG = "maru.io/kv-transfer-config"
_OUR_VOLUMES = (SOCKET_VOLUME, "maru-pool", "maru-token", TMP_VOLUME["name"])
_SHELLS = ("sh", "bash", "dash", "ash", "zsh")


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """What injection needs to know about one MaruCache, read from its body."""

    ref: CacheRef
    spec: CacheSpec | None
    placement: Placement | None
    phase: str
    problem: str = ""


def cache_info(body: Mapping[str, Any], default_image: str = DEFAULT_IMAGE) -> CacheInfo:
    meta = body.get("metadata") or {}
    fallback = CacheRef(str(meta.get("namespace") or "default"), str(meta.get("name") or ""), str(meta.get("uid") or ""))
    status = body.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    try:
        ref, spec = parse_cache(body, default_image)
    except SpecError as exc:
        return CacheInfo(fallback, None, None, phase, str(exc))
    allocations = status.get("allocations") or []
    placement = placement_from_status(ref, allocations[0]) if allocations else None
    return CacheInfo(ref, spec, placement, phase)


def placement_from_status(ref: CacheRef, raw: Mapping[str, Any]) -> Placement | None:
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
    """A merge patch for the pod; `injected`, or `refused` (skipped with a reason worth an Event)."""

    patch: dict[str, Any]
    injected: bool
    reason: str
    refused: bool = False


def skip(reason: str) -> Decision:
    return Decision({"metadata": {"annotations": {ANNOTATION_SKIPPED: reason}}}, False, reason, refused=True)


def decide(pod: Mapping[str, Any], cache_name: str, info: CacheInfo | None, native: bool = False) -> Decision:
    """Plan the mutation of `pod` for the cache it names; `native`: the cluster runs native sidecars."""
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
    index, problem = pick_container(containers, annotations.get(ANNOTATION_CONTAINER))
    if index is None:
        return skip(problem)
    clash = _name_clash(containers + list(spec.get("initContainers") or []), spec.get("volumes") or [])
    if clash:
        return skip(clash)
    shell = _shell_script(containers[index])
    if shell is not None and not _has_user_config(containers[index]) and CONFIG_ENV not in shell:
        return skip(f"container {containers[index].get('name')!r} runs a shell script, where arguments cannot "
                    f"be appended; add {CONFIG_FLAG} \"${CONFIG_ENV}\" to the vLLM command in the script "
                    "(the webhook then adds the variable and the sidecar)")
    return _inject(pod, containers, index, info, native, append_args=shell is None)


def is_vllm(container: Mapping[str, Any]) -> bool:
    words = [str(container.get("name") or ""), str(container.get("image") or "")]
    words += [str(w) for w in list(container.get("command") or []) + list(container.get("args") or [])]
    return any("vllm" in w.lower() for w in words)


def pick_container(containers: Sequence[Mapping[str, Any]], named: str | None) -> tuple[int | None, str]:
    """(index of the vLLM container, "") or (None, why none can be picked)."""
    names = [c.get("name") for c in containers]
    if named:
        if named not in names:
            return None, f"container {named!r} named by {ANNOTATION_CONTAINER} is not in the pod ({names})"
        return names.index(named), ""
    running = [i for i, c in enumerate(containers) if is_vllm(c)]
    if len(running) == 1:
        return running[0], ""
    if not running and len(containers) == 1:
        return 0, ""
    which = "several containers look like vLLM" if running else "no container looks like vLLM"
    return None, f"{which} ({names}); name the vLLM container in the annotation {ANNOTATION_CONTAINER}"


def _shell_script(container: Mapping[str, Any]) -> str | None:
    """The script of a `sh -c SCRIPT` container, else None."""
    words = [str(w) for w in list(container.get("command") or []) + list(container.get("args") or [])]
    if len(words) >= 2 and os.path.basename(words[0]) in _SHELLS and "-c" in words[1:]:
        return " ".join(words[words.index("-c", 1) + 1:])
    return None


def _name_clash(containers: Sequence[Mapping[str, Any]], volumes: Sequence[Mapping[str, Any]]) -> str:
    if any(c.get("name") == SIDECAR_NAME for c in containers):
        return f"the pod already has a container named {SIDECAR_NAME}"
    taken = sorted({str(v.get("name")) for v in volumes} & set(_OUR_VOLUMES))
    return f"the pod already has volumes named {', '.join(taken)}" if taken else ""


def _inject(pod: Mapping[str, Any], containers: list[dict[str, Any]], index: int, info: CacheInfo, native: bool,
            append_args: bool) -> Decision:
    assert info.spec is not None and info.placement is not None  # checked by decide()
    spec = pod.get("spec") or {}
    vllm = copy.deepcopy(containers[index])
    user_config = _has_user_config(vllm)
    # The connector reads its pod's credential from the socket volume; only a user's own config may
    # name the cache token's file, so only then does the vLLM container see the token.
    vllm["volumeMounts"] = list(vllm.get("volumeMounts") or []) + [
        {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR}] + ([dict(TOKEN_MOUNT)] if user_config else [])
    if not user_config:
        vllm["env"] = list(vllm.get("env") or []) + [
            {"name": CONFIG_ENV, "valueFrom": {"configMapKeyRef": {"name": config_map_name(info.ref.name),
                                                                    "key": CREDENTIAL_CONFIG_KEY}}}]
        if append_args:
            vllm["args"] = list(vllm.get("args") or []) + [CONFIG_FLAG, f"$({CONFIG_ENV})"]
    containers = containers[:index] + [vllm] + containers[index + 1:]
    sidecar = sidecar_container(info)
    patch_spec: dict[str, Any] = {
        "volumes": list(spec.get("volumes") or []) + [
            v for v in ({"name": SOCKET_VOLUME, "emptyDir": {}}, pool_volume(info.placement),
                        token_volume(info.ref, mode=0o444), TMP_VOLUME) if v],
        "affinity": with_node_affinity(spec.get("affinity"), info.placement.nodes),
        "securityContext": _with_socket_group(spec.get("securityContext"), info.spec.sidecar.socket_group),
    }
    if native:  # starts before vLLM, stops after it, and does not keep a Job's pod alive
        patch_spec["initContainers"] = [{**sidecar, "restartPolicy": "Always"}] + list(spec.get("initContainers") or [])
        patch_spec["containers"] = containers
    else:
        patch_spec["containers"] = containers + [sidecar]
    region = Region(info.placement.device_uuid, info.placement.offset, info.placement.size)
    notes = {ANNOTATION_INJECTED: info.ref.name, ANNOTATION_SKIPPED: None,
             ANNOTATION_PLACEMENT: fingerprint(info.placement), ANNOTATION_REGION: region.text}
    if user_config:
        notes[ANNOTATION_USER_CONFIG] = "user-provided: left unchanged"
    return Decision({"metadata": {"annotations": notes}, "spec": patch_spec}, True, "injected")


def _with_socket_group(context: Mapping[str, Any] | None, group: int) -> dict[str, Any]:
    result = copy.deepcopy(dict(context or {}))
    groups = list(result.get("supplementalGroups") or [])
    result["supplementalGroups"] = groups if group in groups else groups + [group]
    return result


def _has_user_config(container: Mapping[str, Any]) -> bool:
    """The user passes a config of their own (a script that passes $MARU_KV_TRANSFER_CONFIG does not)."""
    words = list(container.get("command") or []) + list(container.get("args") or [])
    if any(w == CONFIG_FLAG or str(w).startswith(f"{CONFIG_FLAG}=") for w in words):
        return True
    script = _shell_script(container)
    return script is not None and CONFIG_FLAG in script and CONFIG_ENV not in script


def sidecar_container(info: CacheInfo) -> dict[str, Any]:
    assert info.spec is not None and info.placement is not None
    spec, placement = info.spec, info.placement
    command = ["marucache", "sidecar", "--pool", placement.pool_path]
    if placement.offset:
        command += ["--pool-offset", str(placement.offset)]
    command += ["--socket", SOCKET_PATH, "--socket-group", str(spec.sidecar.socket_group),
                "--index", index_url(info.ref, spec), "--token-file", TOKEN_FILE,
                "--credential-file", CREDENTIAL_FILE,  # minted from POD_NAMESPACE/POD_NAME (env below)
                "--metrics-port", str(spec.sidecar.metrics_port), "--cache", info.ref.name]
    mounts = [{"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR}, pool_mount(placement), dict(TOKEN_MOUNT), TMP_MOUNT]
    return {
        "name": SIDECAR_NAME,
        "image": spec.sidecar.image,
        "command": command,
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": [{"name": "maru-metrics", "containerPort": spec.sidecar.metrics_port, "protocol": "TCP"}],
        # Ready means the hand-off works (pool attached, socket served), never that the index answers.
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": spec.sidecar.metrics_port}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": spec.sidecar.metrics_port}, "periodSeconds": 10},
        "resources": with_device(spec.sidecar.resources, spec, placement),
        "securityContext": {**CONTAINER_SECURITY, "runAsUser": DEFAULT_UID, "runAsGroup": DEFAULT_UID},
        "volumeMounts": [m for m in mounts if m],
    }
