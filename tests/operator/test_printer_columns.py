"""`kubectl get marucaches` columns: Ready, Device and Nodes read from a status the real operator wrote."""

from __future__ import annotations

import re
from typing import Any

import yaml

from kube_helpers import CRD_PATH, Kube, condition, wait_for
from maru_tools.kube_emulator import OperatorThread

# The part of kubectl's JSONPath the columns use: .field, [N] and [?(@.field=="value")].
STEP = re.compile(r'\.(?P<field>[A-Za-z]+)|\[(?P<index>\d+)\]|\[\?\(@\.(?P<key>[A-Za-z]+)=="(?P<value>[^"]*)"\)\]')


def json_path(obj: Any, path: str) -> Any:
    """The first value `path` selects in `obj`, None when it selects nothing."""
    pos = 0
    while pos < len(path):
        step = STEP.match(path, pos)
        assert step, f"unsupported JSONPath at {path[pos:]!r}"
        pos = step.end()
        if step["field"]:
            obj = obj.get(step["field"]) if isinstance(obj, dict) else None
        elif step["index"]:
            obj = obj[int(step["index"])] if isinstance(obj, list) and len(obj) > int(step["index"]) else None
        else:
            obj = next((o for o in obj or () if o.get(step["key"]) == step["value"]), None)
        if obj is None:
            return None
    return obj


def columns() -> dict[str, str]:
    (version,) = yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"]
    return {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}


def test_json_path_reads_the_kubectl_subset():
    body = {"status": {"conditions": [{"type": "A", "status": "x"}, {"type": "Ready", "status": "True"}],
                       "allocations": [{"nodes": ["n1"]}]}}
    assert json_path(body, '.status.conditions[?(@.type=="Ready")].status') == "True"
    assert json_path(body, ".status.allocations[0].nodes") == ["n1"]
    assert json_path(body, ".status.allocations[1].nodes") is None


def test_the_columns_show_readiness_device_and_nodes_of_a_served_cache(kube: Kube, operator: OperatorThread):
    shown = columns()
    assert list(shown)[:2] == ["Ready", "Phase"] and {"Device", "Nodes", "Size", "Used", "Age"} <= set(shown)
    kube.apply_cache("listed", {"pool": {"deviceClass": "dax", "size": "2Gi"}})
    starting = wait_for(lambda: (c := kube.cache("listed")) and (condition(c, "DevicesAllocated") or {}).get(
        "status") == "True" and c, what="allocation")
    assert json_path(starting, shown["Ready"]) == "False"
    kube.make_index_available("listed")
    body = wait_for(lambda: (c := kube.cache("listed")) and (condition(c, "Ready") or {}).get("status") == "True"
                    and c, what="Ready")
    assert json_path(body, shown["Ready"]) == "True" and json_path(body, shown["Phase"]) == "Ready"
    assert json_path(body, shown["Device"]) == "cxl-a"
    assert json_path(body, shown["Nodes"]) == ["rack-a-1", "rack-a-2"]


def test_an_unplaced_cache_shows_no_device(kube: Kube, operator: OperatorThread):
    kube.apply_cache("nowhere", {"pool": {"deviceClass": "dax", "size": "900Gi"}})
    body = wait_for(lambda: (c := kube.cache("nowhere")) and (c.get("status") or {}).get("phase") == "Invalid" and c,
                    what="Invalid")
    shown = columns()
    assert json_path(body, shown["Ready"]) == "False"
    assert json_path(body, shown["Device"]) is None and json_path(body, shown["Nodes"]) is None
