"""What the cluster's nodes offer: DAX devices and tmpfs capacity (pure).

Nodes advertise CXL DAX devices with the label `maru.io/cxl=true` and the
annotation `maru.io/dax-devices`, a JSON list of `{"path", "size", "uuid"}`.
One device may sit behind a CXL switch and appear on several nodes under the
same UUID (its path may differ per node): it is one device, shared by all of
them. Nodes offer tmpfs pools with the label `maru.io/shm=true` and their
capacity in the annotation `maru.io/shm-size`; each such node is a device of
its own (`shm:<node>`), since tmpfs is not shared between hosts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from . import ANNOTATION_DAX_DEVICES, ANNOTATION_SHM_SIZE, LABEL_CXL, LABEL_SHM
from .models import SpecError, parse_quantity_bytes

# Host directory that holds tmpfs pool files on `shm` nodes.
SHM_HOST_DIR = "/dev/shm/marucache"


@dataclasses.dataclass(frozen=True)
class NodeDevice:
    """One device as one node sees it."""

    uuid: str
    device_class: str
    path: str
    size: int


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What one node offers, parsed from its labels and annotations."""

    name: str
    labels: Mapping[str, str]
    devices: tuple[NodeDevice, ...] = ()
    problems: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Device:
    """A device the ledger can carve regions from, with every node that sees it."""

    uuid: str
    device_class: str
    size: int
    paths: Mapping[str, str]  # node name -> device path (dax) or pool directory (shm)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted(self.paths))


def parse_node(body: Mapping[str, Any]) -> NodeInfo:
    """Read a Node's advertisement; malformed annotations become `problems`."""
    meta = body.get("metadata") or {}
    name = str(meta.get("name") or "")
    labels = dict(meta.get("labels") or {})
    annotations = meta.get("annotations") or {}
    devices: list[NodeDevice] = []
    problems: list[str] = []
    if labels.get(LABEL_CXL) == "true":
        raw = annotations.get(ANNOTATION_DAX_DEVICES)
        if raw is None:
            problems.append(f"node {name} is labelled {LABEL_CXL}=true but has no {ANNOTATION_DAX_DEVICES} annotation")
        else:
            parsed, errors = _parse_dax_devices(name, raw)
            devices += parsed
            problems += errors
    if labels.get(LABEL_SHM) == "true":
        raw = annotations.get(ANNOTATION_SHM_SIZE)
        try:
            size = parse_quantity_bytes(raw, ANNOTATION_SHM_SIZE)
            devices.append(NodeDevice(uuid=f"shm:{name}", device_class="shm", path=SHM_HOST_DIR, size=size))
        except SpecError:
            problems.append(f"node {name}: annotation {ANNOTATION_SHM_SIZE}={raw!r} must be a quantity such as 16Gi")
    return NodeInfo(name=name, labels=labels, devices=tuple(devices), problems=tuple(problems))


def _parse_dax_devices(node: str, raw: str) -> tuple[list[NodeDevice], list[str]]:
    hint = f'node {node}: annotation {ANNOTATION_DAX_DEVICES} must be a JSON list of {{"path", "size", "uuid"}}'
    try:
        entries = json.loads(raw)
    except (TypeError, ValueError):
        return [], [f"{hint}; it is not valid JSON"]
    if not isinstance(entries, list):
        return [], [hint]
    devices, problems = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not all(isinstance(entry.get(k), str) for k in ("path", "uuid")):
            problems.append(f"{hint}; entry {i} lacks a string path or uuid")
            continue
        try:
            size = parse_quantity_bytes(entry.get("size"), "size")
        except SpecError:
            problems.append(f"{hint}; entry {i} has size {entry.get('size')!r}, not bytes or a quantity")
            continue
        devices.append(NodeDevice(uuid=entry["uuid"], device_class="dax", path=entry["path"], size=size))
    return devices, problems


def build_devices(nodes: Iterable[NodeInfo]) -> dict[str, Device]:
    """Merge per-node views into devices keyed by UUID.

    A UUID seen on several nodes is one shared device; if the nodes disagree
    on its size, the smallest is used so no region can run past the end.
    """
    merged: dict[str, Device] = {}
    for node in sorted(nodes, key=lambda n: n.name):
        for dev in node.devices:
            seen = merged.get(dev.uuid)
            if seen is None:
                merged[dev.uuid] = Device(dev.uuid, dev.device_class, dev.size, {node.name: dev.path})
            else:
                merged[dev.uuid] = Device(dev.uuid, seen.device_class, min(seen.size, dev.size),
                                          {**seen.paths, node.name: dev.path})
    return merged


def candidate_devices(nodes: Iterable[NodeInfo], device_class: str,
                      node_selector: Mapping[str, str]) -> list[Device]:
    """Devices of `device_class`, each limited to the nodes the selector admits."""
    admitted = [n for n in nodes if all(n.labels.get(k) == v for k, v in node_selector.items())]
    return sorted((d for d in build_devices(admitted).values() if d.device_class == device_class),
                  key=lambda d: d.uuid)
