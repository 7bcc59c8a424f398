"""What a MaruCache should own in the cluster (pure: spec -> manifests).

Every function here is deterministic: the same cache, placement and token
give byte-identical manifests, which is what lets a reconcile compare and
skip writes (idempotence). Names of children:

- `<name>-maru-config`  ConfigMap: `kv-transfer-config-credential.json` (for
  vLLM's `--kv-transfer-config`: the connector presents its pod's credential),
  `kv-transfer-config.json` (the same but for the cache token's file: the key
  pods injected by an earlier operator read) and `sidecar.json` (the
  sidecar's settings);
- `<name>-maru-token`   Secret: `token`, the index's shared secret (the
  cache token, from which each sidecar mints its pod's credential);
- `<name>-maru-index`   Deployment, Service and NetworkPolicy of the index.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from maru_core.connector_config import ConnectorKnobs, KvTransferConfig, kv_transfer_config as build_kv_transfer_config
from maru_core.storage_format import StorageFormat

from . import API_VERSION, KIND, LABEL_CACHE, MANAGED_BY
from .inventory import Device
from .ledger import Claim
from .models import DEFAULT_UID, DEVICE_PLACEHOLDER, CacheRef, CacheSpec

SOCKET_DIR = "/var/run/maru"
SOCKET_PATH = f"{SOCKET_DIR}/sidecar.sock"
TOKEN_DIR = "/var/run/maru-token"
TOKEN_FILE = f"{TOKEN_DIR}/token"
# The pod's own credential (maru_core.pod_credentials), which the sidecar mints from the cache token and
# writes into the socket's volume: the one the vLLM container reads, which never sees the cache token.
CREDENTIAL_FILE = f"{SOCKET_DIR}/credential"
SHM_MOUNT = "/var/lib/marucache/pool"
# The config injected pods read: the connector presents its pod's credential.
CREDENTIAL_CONFIG_KEY = "kv-transfer-config-credential.json"
# The same config naming the cache token's file: pods injected by an earlier operator read this key and
# mount the token, and a vLLM container re-reads the key whenever it restarts, so it keeps naming the token
# (their sidecar may write no credential).
CONFIG_KEY = "kv-transfer-config.json"
SIDECAR_KEY = "sidecar.json"
LABEL_INDEX_OF = "maru.io/index-of"  # on index pods; never maru.io/cache, which opts pods into injection
# Python needs a writable /tmp under a read-only root file system.
TMP_VOLUME = {"name": "maru-tmp", "emptyDir": {"sizeLimit": "64Mi"}}
TMP_MOUNT = {"name": "maru-tmp", "mountPath": "/tmp"}


def config_map_name(name: str) -> str:
    return f"{name}-maru-config"


def secret_name(name: str) -> str:
    return f"{name}-maru-token"


def index_name(name: str) -> str:
    return f"{name}-maru-index"


def index_url(ref: CacheRef, spec: CacheSpec) -> str:
    return f"tcp://{index_name(ref.name)}.{ref.namespace}.svc:{spec.index.port}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a cache's pool lives: a claimed region and the nodes that reach it.

    `host_path` is the DAX device's path (the same on every node in `nodes`)
    or the tmpfs directory of an `shm` node; `pool_path` is what the index
    and the sidecar open inside their containers.
    """

    device_class: str
    device_uuid: str
    host_path: str
    offset: int
    size: int
    nodes: tuple[str, ...]
    pool_path: str

    def to_status(self) -> dict[str, Any]:
        return {"deviceUUID": self.device_uuid, "deviceClass": self.device_class, "offset": self.offset,
                "size": self.size, "nodes": list(self.nodes), "paths": {n: self.host_path for n in self.nodes}}


def fingerprint(placement: Placement) -> str:
    """A short digest of what a pod maps: injected pods record it (`maru.io/placement`); a pod whose
    digest differs from its cache's current one runs with an old region and needs a restart.

    Only the region (device, offset, size) and the path a pod opens count, not the nodes that reach
    the device: a node lost or added moves nothing a running pod maps.
    """
    mapped = {"deviceUUID": placement.device_uuid, "deviceClass": placement.device_class,
              "offset": placement.offset, "size": placement.size, "hostPath": placement.host_path,
              "poolPath": placement.pool_path}
    text = json.dumps(mapped, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def affinity_nodes(deployment: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The node names the operator's own term of an index Deployment's node affinity admits."""
    spec = ((deployment or {}).get("spec") or {}).get("template", {}).get("spec") or {}
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    for term in required.get("nodeSelectorTerms") or ():
        for field in term.get("matchFields") or ():
            if field.get("key") == "metadata.name" and field.get("operator") == "In":
                return tuple(field.get("values") or ())
    return ()


def place(ref: CacheRef, claim: Claim, device: Device) -> Placement:
    """Pick the device path and nodes for a claim.

    A device behind a CXL switch may have different paths on different
    nodes; a pod spec can mount only one, so the most common path wins
    (ties: the smallest) and pods are kept to the nodes that use it.
    """
    counts: dict[str, int] = {}
    for path in device.paths.values():
        counts[path] = counts.get(path, 0) + 1
    host_path = min(counts, key=lambda p: (-counts[p], p))
    nodes = tuple(sorted(n for n, p in device.paths.items() if p == host_path))
    if claim.device_class == "shm":
        pool_path = f"{SHM_MOUNT}/{ref.namespace}.{ref.name}.{claim.region.size}.pool"
    else:
        pool_path = host_path
    return Placement(claim.device_class, device.uuid, host_path, claim.region.offset, claim.region.size,
                     nodes, pool_path)


def owner_reference(ref: CacheRef) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": ref.name, "uid": ref.uid,
            "controller": True, "blockOwnerDeletion": True}


def labels(ref: CacheRef, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "marucache", "app.kubernetes.io/instance": ref.name,
            "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": MANAGED_BY}


def _metadata(ref: CacheRef, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": ref.namespace, "labels": labels(ref, component),
            "ownerReferences": [owner_reference(ref)]}


# The knobs every vLLM pod's config names, also where they equal the connector's defaults: the pods keep the
# cache's settings (chunk size and format are part of every key) whatever a later connector defaults to.
WRITTEN_KNOBS = ("maru_index_url", "maru_sidecar_socket", "maru_token_file", "maru_cache_name",
                 "maru_kv_chunk_tokens", "maru_format", "maru_async_load", "maru_park_lone_hits",
                 "maru_overlap_load_with_compute", "maru_overlap_release_after_layers")


def connector_knobs(ref: CacheRef, spec: CacheSpec, token_file: str = CREDENTIAL_FILE) -> ConnectorKnobs:
    """The connector knobs a MaruCache's vLLM pods run with, presenting what `token_file` holds."""
    return ConnectorKnobs(
        maru_index_url=index_url(ref, spec),
        maru_sidecar_socket=SOCKET_PATH,
        maru_token_file=token_file,
        maru_cache_name=ref.name,
        maru_kv_chunk_tokens=spec.storage.chunk_tokens,
        maru_format=spec.storage.layout,
        maru_async_load=spec.load.async_load,
        maru_park_lone_hits=spec.load.park_lone_hits,
        maru_overlap_load_with_compute=spec.load.overlap_with_compute,
        maru_overlap_release_after_layers=spec.load.release_after_layers,
    )


def kv_transfer_config(ref: CacheRef, spec: CacheSpec, token_file: str = CREDENTIAL_FILE) -> KvTransferConfig:
    """The `--kv-transfer-config` every vLLM pod of this cache runs with (`token_file`: the pod's
    credential, or the cache token's file for pods injected by an earlier operator).

    The format goes out in its older spelling, `maru_use_layerwise`, which
    every release's connector reads: a connector of the previous release
    refuses `maru_format` as an unknown key, and during an upgrade pods of
    both releases run with this config."""
    config = build_kv_transfer_config(connector_knobs(ref, spec, token_file), WRITTEN_KNOBS)
    extra = dict(config["kv_connector_extra_config"])
    extra["maru_use_layerwise"] = StorageFormat(extra.pop("maru_format")) is StorageFormat.LAYERWISE
    config["kv_connector_extra_config"] = extra
    return config


def pool_args(placement: Placement) -> list[str]:
    """Flags that name the pool; `--pool-offset` only for a region past a device's start."""
    args = ["--pool", placement.pool_path, "--pool-size", str(placement.size)]
    if placement.offset:
        args += ["--pool-offset", str(placement.offset)]
    return args


def sidecar_settings(ref: CacheRef, spec: CacheSpec, placement: Placement) -> dict[str, Any]:
    return {"cache": ref.name, "namespace": ref.namespace, "pool": placement.pool_path,
            "poolOffset": placement.offset, "poolSize": placement.size, "deviceClass": placement.device_class,
            "socket": SOCKET_PATH, "index": index_url(ref, spec), "tokenFile": TOKEN_FILE,
            "credentialFile": CREDENTIAL_FILE,
            "metricsPort": spec.sidecar.metrics_port, "nodes": list(placement.nodes)}


def config_map(ref: CacheRef, spec: CacheSpec, placement: Placement) -> dict[str, Any]:
    dump = lambda obj: json.dumps(obj, sort_keys=True, separators=(",", ":"))  # noqa: E731
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(ref, config_map_name(ref.name), "config"),
            "data": {CREDENTIAL_CONFIG_KEY: dump(kv_transfer_config(ref, spec)),
                     CONFIG_KEY: dump(kv_transfer_config(ref, spec, TOKEN_FILE)),
                     SIDECAR_KEY: dump(sidecar_settings(ref, spec, placement))}}


def token_secret(ref: CacheRef, token: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _metadata(ref, secret_name(ref.name), "token"),
            "stringData": {"token": token}}


def node_affinity(nodes: tuple[str, ...]) -> dict[str, Any]:
    """Keep a pod on the nodes that reach the pool."""
    return with_node_affinity(None, nodes)


def with_node_affinity(affinity: Mapping[str, Any] | None, nodes: Sequence[str]) -> dict[str, Any]:
    """AND the pool's nodes into every required node-selector term of `affinity` (kept otherwise)."""
    result = copy.deepcopy(dict(affinity or {}))
    ours = {"key": "metadata.name", "operator": "In", "values": list(nodes)}
    node_affinity = result.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [{**t, "matchFields": list(t.get("matchFields") or []) + [ours]} for t in terms]
    return result


def pool_volume(placement: Placement) -> dict[str, Any] | None:
    """The tmpfs directory of an `shm` pool; None for DAX (the device plugin brings the device)."""
    if placement.device_class == "shm":
        return {"name": "maru-pool", "hostPath": {"path": placement.host_path, "type": "Directory"}}
    return None


def pool_mount(placement: Placement) -> dict[str, Any] | None:
    if placement.device_class == "shm":
        return {"name": "maru-pool", "mountPath": SHM_MOUNT}
    return None


def device_resource(spec: CacheSpec, placement: Placement) -> str:
    """The extended resource of the device the region is on: `pool.deviceResource` with `{device}`
    replaced by the device's name (`squat.ai/dax1.0` for `/dev/dax1.0`, the same path on every node
    of the placement), so that the plugin hands a pod that device, not any DAX device of its node."""
    return spec.pool.device_resource.replace(DEVICE_PLACEHOLDER, posixpath.basename(placement.host_path))


def with_device(resources: Mapping[str, Any], spec: CacheSpec, placement: Placement) -> dict[str, Any]:
    """`resources` plus one unit of the DAX device plugin's resource (requests and limits alike)."""
    result = copy.deepcopy(dict(resources))
    if placement.device_class != "dax":
        return result
    for kind in ("requests", "limits"):
        if kind == "limits" or kind in result:
            result[kind] = {**(result.get(kind) or {}), device_resource(spec, placement): "1"}
    return result


def token_volume(ref: CacheRef, mode: int = 0o440) -> dict[str, Any]:
    """The index token. 0440 in the index pod, whose fsGroup owns it; 0444 in a vLLM pod, whose
    fsGroup the webhook leaves alone (it would re-own the user's volumes), so that the sidecar (and
    the vLLM container of a user's own config, of any user) can read it — only containers that mount
    it can."""
    return {"name": "maru-token", "secret": {"secretName": secret_name(ref.name), "defaultMode": mode}}


TOKEN_MOUNT = {"name": "maru-token", "mountPath": TOKEN_DIR, "readOnly": True}
# Pod Security "restricted" for the index and the sidecar; the image's user (Dockerfile) is 65532.
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": DEFAULT_UID, "runAsGroup": DEFAULT_UID,
                "fsGroup": DEFAULT_UID, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                      "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def index_deployment(ref: CacheRef, spec: CacheSpec, placement: Placement) -> dict[str, Any]:
    """One index per pool: `Recreate`, so two never serve the same pool at once.

    No PodDisruptionBudget: a budget for a single replica either blocks every
    drain of its node or allows everything. A drain moves the index; meanwhile
    sidecars stay Ready and connectors miss (vLLM recomputes).
    """
    pod_labels = {**labels(ref, "index"), LABEL_INDEX_OF: ref.name}
    sched = spec.index.scheduling
    container = {
        "name": "index",
        "image": spec.index.image,
        "command": ["marucache", "index", *pool_args(placement),
                    "--listen", f"tcp://0.0.0.0:{spec.index.port}", "--token-file", TOKEN_FILE,
                    "--metrics-port", str(spec.index.metrics_port),
                    "--high-watermark", str(spec.eviction.high_watermark),
                    "--low-watermark", str(spec.eviction.low_watermark)],
        "ports": [{"name": "index", "containerPort": spec.index.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": spec.index.metrics_port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "index"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "index"}, "periodSeconds": 10, "failureThreshold": 6},
        "resources": with_device(spec.index.resources, spec, placement),
        "securityContext": {**CONTAINER_SECURITY, **sched.security_context},
        "volumeMounts": [m for m in (pool_mount(placement), TOKEN_MOUNT, TMP_MOUNT) if m],
    }
    pod: dict[str, Any] = {
        "containers": [container],
        "affinity": with_node_affinity(sched.affinity, placement.nodes),
        "securityContext": {**POD_SECURITY, **sched.pod_security_context},
        "volumes": [v for v in (pool_volume(placement), token_volume(ref), TMP_VOLUME) if v],
    }
    optional = {"tolerations": list(sched.tolerations), "nodeSelector": dict(sched.node_selector),
                "imagePullSecrets": list(sched.image_pull_secrets), "priorityClassName": sched.priority_class_name}
    pod.update({k: v for k, v in optional.items() if v})
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(ref, index_name(ref.name), "index"),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {LABEL_INDEX_OF: ref.name}},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod},
        },
    }


def index_service(ref: CacheRef, spec: CacheSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(ref, index_name(ref.name), "index"),
            "spec": {"selector": {LABEL_INDEX_OF: ref.name},
                     "ports": [{"name": "index", "port": spec.index.port, "targetPort": "index", "protocol": "TCP"},
                               {"name": "metrics", "port": spec.index.metrics_port, "targetPort": "metrics",
                                "protocol": "TCP"}]}}


def index_network_policy(ref: CacheRef, spec: CacheSpec) -> dict[str, Any]:
    """Only pods labelled `maru.io/cache=<name>` reach the index port; metrics stay scrapeable."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _metadata(ref, index_name(ref.name), "index"),
            "spec": {"podSelector": {"matchLabels": {LABEL_INDEX_OF: ref.name}},
                     "policyTypes": ["Ingress"],
                     "ingress": [
                         {"from": [{"podSelector": {"matchLabels": {LABEL_CACHE: ref.name}}}],
                          "ports": [{"protocol": "TCP", "port": spec.index.port}]},
                         {"ports": [{"protocol": "TCP", "port": spec.index.metrics_port}]}]}}


def children(ref: CacheRef, spec: CacheSpec, placement: Placement,
             index_nodes: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every child except the Secret (its token is made once, see `token_secret`); the index is kept
    to `index_nodes` (default: the placement's nodes)."""
    index_placement = placement if index_nodes is None else dataclasses.replace(placement, nodes=tuple(index_nodes))
    return [config_map(ref, spec, placement), index_deployment(ref, spec, index_placement),
            index_service(ref, spec), index_network_policy(ref, spec)]


def differs(desired: Mapping[str, Any], actual: Mapping[str, Any]) -> bool:
    """True when `actual` lacks or contradicts anything `desired` sets.

    Fields the API server adds (status, uid, defaults in nested objects) are
    ignored, so a reconcile writes only when the operator's intent changed.
    """
    for key, want in desired.items():
        have = actual.get(key)
        if isinstance(want, Mapping):
            if not isinstance(have, Mapping) or differs(want, have):
                return True
        elif isinstance(want, list):
            if not isinstance(have, list) or len(have) != len(want):
                return True
            for w, h in zip(want, have):
                if (isinstance(w, Mapping) and (not isinstance(h, Mapping) or differs(w, h))) or \
                        (not isinstance(w, Mapping) and w != h):
                    return True
        elif want != have:
            return True
    return False
