"""Spec parsing: defaults, and errors that say what to change."""

import pathlib

import pytest
import yaml

from maru_operator.models import SpecError, parse_cache, parse_selector

EXAMPLES = pathlib.Path(__file__).parents[2] / "crds" / "examples"


def body(**spec):
    return {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}, "spec": spec}


def test_minimal_gets_the_documented_defaults():
    ref, spec = parse_cache(yaml.safe_load((EXAMPLES / "minimal.yaml").read_text()))
    assert ref.key == "default/demo"
    assert spec.pool.size == 8 << 30 and spec.pool.device_class == "shm"
    assert (spec.storage.layout, spec.storage.chunk_tokens, spec.storage.block_size) == ("chunkwise", 256, 16)
    assert spec.load.async_load and spec.load.overlap_with_compute and spec.load.release_after_layers == 1
    assert (spec.index.port, spec.index.metrics_port, spec.sidecar.metrics_port) == (7070, 9090, 9091)


def test_complete_example_is_read_field_by_field():
    _, spec = parse_cache(yaml.safe_load((EXAMPLES / "complete.yaml").read_text()))
    assert spec.storage.layout == "layerwise" and spec.load.release_after_layers == 2
    assert spec.eviction.high_watermark == 0.9 and spec.pool.node_selector == {"topology.kubernetes.io/zone": "rack-a"}
    assert spec.pod_selector.matches({"app": "vllm"}) and not spec.pod_selector.matches({"app": "vllm", "tier": "batch"})


@pytest.mark.parametrize("spec, field, hint", [
    ({"pool": {"deviceClass": "nvme", "size": "1Gi"}}, "pool.deviceClass", "dax, shm"),
    ({"pool": {"deviceClass": "dax", "size": "lots"}}, "pool.size", "64Gi"),
    ({"pool": {"deviceClass": "dax", "size": "1Mi"}}, "pool.size", "minimum"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi"}, "storage": {"chunkTokens": 100, "blockSize": 16}},
     "storage.chunkTokens", "use 96 or 112"),
    ({"pool": {"deviceClass": "dax", "size": "1Gi"}, "eviction": {"highWatermark": 0.5, "lowWatermark": 0.6}},
     "eviction.lowWatermark", "below"),
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
