"""The index Deployment the operator renders: schedulable on tainted GPU/CXL nodes, DAX as a device-plugin
resource (no hostPath), Pod Security `restricted` for DAX, the eviction watermarks on its command line,
and strictly valid."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from kube_helpers import EXAMPLES
from maru_operator import desired
from maru_operator.inventory import Device
from maru_operator.ledger import Ledger
from maru_operator.models import parse_cache
from pod_security import baseline_violations, restricted_violations
from test_crd import VALIDATE

COMPLETE = next(p for p in EXAMPLES if p.name == "complete.yaml")
MINIMAL = next(p for p in EXAMPLES if p.name == "minimal.yaml")


def index_of(example, dax_path="/dev/dax0.0", **spec_changes):
    body = yaml.safe_load(example.read_text())
    body["metadata"]["uid"] = "uid-1"
    body["spec"].update(spec_changes)
    ref, spec = parse_cache(body)
    dax = spec.pool.device_class == "dax"
    device = Device("cxl-a" if dax else "shm:n1", spec.pool.device_class, 256 << 30,
                    {"n1": dax_path if dax else "/dev/shm/marucache"})
    _, claim = Ledger().allocate(ref, spec.pool.device_class, spec.pool.size, [device])
    return desired.index_deployment(ref, spec, desired.place(ref, claim, device))


def test_complete_example_schedules_on_tainted_nodes_with_everything_it_asks_for(tmp_path):
    deployment = index_of(COMPLETE)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["priorityClassName"] == "marucache-index"
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert "podAntiAffinity" in pod["affinity"]  # the user's affinity is kept ...
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]  # ... and pinned
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["squat.ai/dax0.0"] == "1"  # the device plugin brings /dev/dax0.0
    cmd = container["command"]
    assert cmd[cmd.index("--high-watermark") + 1] == "0.9" and cmd[cmd.index("--low-watermark") + 1] == "0.8"
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    path = tmp_path / "index.yaml"
    path.write_text(yaml.safe_dump(deployment))
    run = subprocess.run(VALIDATE + [str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_dax_index_meets_pod_security_restricted():
    pod = index_of(COMPLETE)["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    security = pod["containers"][0]["securityContext"]
    assert security["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]


def test_shm_index_needs_privileged_for_its_host_path_and_says_so_in_the_docs():
    pod = index_of(MINIMAL)["spec"]["template"]["spec"]
    assert baseline_violations(pod) == ["hostPath volume maru-pool"]
    volume = next(v for v in pod["volumes"] if v["name"] == "maru-pool")
    assert volume["hostPath"] == {"path": "/dev/shm/marucache", "type": "Directory"}


@pytest.mark.parametrize("override", [{"runAsUser": 0}, {"allowPrivilegeEscalation": True}])
def test_the_checker_catches_what_restricted_refuses(override):
    pod = index_of(COMPLETE, index={"securityContext": override})["spec"]["template"]["spec"]
    assert restricted_violations(pod)


@pytest.mark.parametrize("resource, path, requested", [
    ("squat.ai/{device}", "/dev/dax1.0", "squat.ai/dax1.0"),  # the device the region is on, not dax0.0
    ("example.com/cxl-{device}", "/dev/dax3.1", "example.com/cxl-dax3.1"),
    ("example.com/cxl", "/dev/dax1.0", "example.com/cxl"),  # one resource for all, as written
])
def test_the_index_requests_the_device_its_region_is_on(resource, path, requested):
    pool = {"deviceClass": "dax", "size": "1Gi", "deviceResource": resource}
    (container,) = index_of(COMPLETE, dax_path=path, pool=pool)["spec"]["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    assert limits[requested] == "1" and not [k for k in limits if "dax" in k and k != requested]
