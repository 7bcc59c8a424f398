"""Spec parsing: defaults, and errors that say what to change."""

import pathlib

import pytest
import yaml

from maru_connector.config import parse_config
from maru_operator import desired
from maru_operator.models import SpecError, parse_cache, parse_selector

EXAMPLES = pathlib.Path(__file__).parents[2] / "crds" / "examples"


def body(**spec):
    return {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}, "spec": spec}


def test_minimal_gets_the_documented_defaults():
    ref, spec = parse_cache(yaml.safe_load((EXAMPLES / "minimal.yaml").read_text()))
    assert ref.key == "default/demo"
    assert spec.pool.size == 8 << 30 and spec.pool.device_class == "shm"
    assert (spec.storage.layout, spec.storage.chunk_tokens) == ("chunkwise", 256)
    assert spec.pool.device_resource == "squat.ai/{device}"
    sidecar = spec.sidecar.resources
    assert sidecar["requests"] == sidecar["limits"] == {"cpu": "100m", "memory": "128Mi"}  # Guaranteed stays so
    assert spec.sidecar.socket_group == 65532 and spec.index.scheduling.tolerations == ()
    assert spec.load.async_load and spec.load.overlap_with_compute and spec.load.release_after_layers == 1
    assert (spec.index.port, spec.index.metrics_port, spec.sidecar.metrics_port) == (7070, 9090, 9091)


def test_park_lone_hits_reaches_the_connector_config():
    ref, default = parse_cache(body(pool={"deviceClass": "dax", "size": "1Gi"}))
    _, parked = parse_cache(body(pool={"deviceClass": "dax", "size": "1Gi"}, load={"parkLoneHits": True}))
    extra = {name: desired.kv_transfer_config(ref, spec)["kv_connector_extra_config"] for name, spec
             in (("default", default), ("parked", parked))}
    assert extra["default"]["maru_park_lone_hits"] is False and extra["parked"]["maru_park_lone_hits"] is True
    assert parse_config(extra["parked"]).maru_park_lone_hits  # the connector accepts what the operator writes


def test_release_after_no_layer_is_accepted():
    _, spec = parse_cache(body(pool={"deviceClass": "dax", "size": "1Gi"}, load={"releaseAfterLayers": 0}))
    assert spec.load.release_after_layers == 0


def test_complete_example_is_read_field_by_field():
    _, spec = parse_cache(yaml.safe_load((EXAMPLES / "complete.yaml").read_text()))
    assert spec.storage.layout == "layerwise" and spec.load.release_after_layers == 2
    assert spec.eviction.high_watermark == 0.9 and spec.pool.node_selector == {"topology.kubernetes.io/zone": "rack-a"}
    assert spec.pod_selector.matches({"app": "vllm"}) and not spec.pod_selector.matches({"app": "vllm", "tier": "batch"})
    sched = spec.index.scheduling
    assert sched.tolerations[0]["key"] == "nvidia.com/gpu" and sched.priority_class_name == "marucache-index"
    assert sched.image_pull_secrets == ({"name": "regcred"},) and sched.node_selector == {"kubernetes.io/os": "linux"}
    assert "podAntiAffinity" in sched.affinity and sched.pod_security_context == {"runAsUser": 65532}


@pytest.mark.parametrize("spec, field, hint", [
    ({"pool": {"deviceClass": "nvme", "size": "1Gi"}}, "pool.deviceClass", "dax, shm"),
    ({"pool": {"deviceClass": "dax", "size": "lots"}}, "pool.size", "64Gi"),
    ({"pool": {"deviceClass": "dax", "size": "1Mi"}}, "pool.size", "minimum"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi"}, "storage": {"chunkTokens": 96, "blockSize": 16}},
     "storage.blockSize", "delete the field"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi", "deviceResource": "dax"}}, "pool.deviceResource", "squat.ai/dax"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi"}, "index": {"tolerations": {"key": "x"}}}, "index.tolerations",
     "list"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi"}, "sidecar": {"socketGroup": -1}}, "sidecar.socketGroup",
     "between"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi"}, "eviction": {"highWatermark": 0.5, "lowWatermark": 0.6}},
     "eviction.lowWatermark", "below"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi"}, "load": {"releaseAfterLayers": -1}}, "load.releaseAfterLayers",
     "between 0"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi"}, "index": {"port": True}}, "index.port", "int"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi"}, "index": {"port": 9090}}, "index.metricsPort", "differ"),
])
def test_bad_specs_name_the_field_and_the_fix(spec, field, hint):
    with pytest.raises(SpecError) as err:
        parse_cache(body(**spec))
    assert err.value.field == field and hint in str(err.value)


def test_selector_operators():
    sel = parse_selector({"matchExpressions": [{"key": "a", "operator": "Exists"},
                                               {"key": "b", "operator": "DoesNotExist"}]}, "podSelector")
    assert sel.matches({"a": "1"}) and not sel.matches({"a": "1", "b": "2"}) and not sel.matches({})
    with pytest.raises(SpecError, match="needs at least one value"):
        parse_selector({"matchExpressions": [{"key": "a", "operator": "In"}]}, "podSelector")
