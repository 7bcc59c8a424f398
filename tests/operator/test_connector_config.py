"""The seam between operator and connector: what the operator writes into its pods' config is read by the
connector's own parser as the MaruCache asked, and both take their names from maru_core."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from kube_helpers import CRD_PATH, ROOT, crd_schema
from maru_connector.config import parse_config
from maru_core.connector_config import KNOB_NAMES, ConnectorKnobs
from maru_core.storage_format import StorageFormat
from maru_operator import desired
from maru_operator.models import OPERATOR_PROFILE, parse_cache

CHART_CRD = ROOT / "charts" / "marucache" / "templates" / "crd-marucaches.yaml"
SHM = desired.Placement("shm", "shm-n1", "/dev/shm/marucache", 0, 1 << 30, ("n1",),
                        f"{desired.SHM_MOUNT}/ns.c.1073741824.pool")

SPECS = {
    "defaults": {},
    "layerwise, small chunks": {"storage": {"layout": "layerwise", "chunkTokens": 64}},
    "chunkwise, sync": {"storage": {"layout": "chunkwise", "chunkTokens": 512},
                        "load": {"async": False, "overlapWithCompute": False}},
    "parked, released at once": {"load": {"parkLoneHits": True, "releaseAfterLayers": 0},
                                 "index": {"port": 7171, "metricsPort": 9191}},
}


def _rendered_extra_config(spec: dict) -> tuple[object, object, dict]:
    body = {"metadata": {"name": "c", "namespace": "ns", "uid": "u"},
            "spec": {"pool": {"deviceClass": "shm", "size": "1Gi"}, **spec}}
    ref, parsed = parse_cache(body)
    config_map = desired.config_map(ref, parsed, SHM)
    rendered = json.loads(config_map["data"][desired.CREDENTIAL_CONFIG_KEY])  # the bytes an injected vLLM pod reads
    assert rendered["kv_connector"] == "MaruKVConnector" and rendered["kv_load_failure_policy"] == "recompute"
    return ref, parsed, rendered["kv_connector_extra_config"]


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_the_connector_parses_what_the_operator_writes_as_the_spec_asked(spec):
    ref, parsed, extra = _rendered_extra_config(spec)
    cfg = parse_config(extra)
    storage, load = spec.get("storage", {}), spec.get("load", {})
    asked = {
        "maru_index_url": f"tcp://c-maru-index.ns.svc:{spec.get('index', {}).get('port', 7070)}",
        "maru_sidecar_socket": desired.SOCKET_PATH, "maru_token_file": desired.CREDENTIAL_FILE, "maru_cache_name": "c",
        "maru_kv_chunk_tokens": storage.get("chunkTokens", 256),
        "maru_format": StorageFormat(storage.get("layout", "chunkwise")),
        "maru_async_load": load.get("async", True), "maru_park_lone_hits": load.get("parkLoneHits", False),
        "maru_overlap_load_with_compute": load.get("overlapWithCompute", True),
        "maru_overlap_release_after_layers": load.get("releaseAfterLayers", 1),
    }
    assert {name: getattr(cfg, name) for name in asked} == asked
    assert cfg.storage_format is asked["maru_format"]
    # Everything the spec does not set stays at the connector's own default.
    untouched = [f for f in dataclasses.fields(ConnectorKnobs) if f.name not in asked]
    assert untouched and all(getattr(cfg, f.name) == f.default for f in untouched)


def _layout_enums() -> dict[str, list[str]]:
    chart = CHART_CRD.read_text()
    spec_text = chart[chart.index("\nspec:\n"):chart.rindex("{{- end }}")]  # the template's verbatim part
    chart_schema = yaml.safe_load(spec_text)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    layout = lambda schema: schema["properties"]["spec"]["properties"]["storage"]["properties"]["layout"]  # noqa: E731
    return {str(CRD_PATH.relative_to(ROOT)): layout(crd_schema())["enum"],
            str(CHART_CRD.relative_to(ROOT)): layout(chart_schema)["enum"]}


def test_the_crd_and_the_chart_list_exactly_the_storage_formats():
    formats = [f.value for f in StorageFormat]
    for where, enum in _layout_enums().items():
        assert enum == formats, f"{where}: storage.layout's enum {enum} must be {formats} (StorageFormat)"


def test_the_operator_profile_names_knobs_it_runs_other_than_the_connectors_defaults():
    """A profile entry equal to the connector's default is a second default: remove it."""
    defaults = {f.name: f.default for f in dataclasses.fields(ConnectorKnobs)}
    assert set(OPERATOR_PROFILE) <= set(KNOB_NAMES)
    assert all(defaults[name] != value for name, value in OPERATOR_PROFILE.items())


def test_an_empty_spec_runs_the_connectors_defaults_but_for_the_profile():
    _, _, extra = _rendered_extra_config({})
    cfg = parse_config(extra)
    expected = {**{f.name: f.default for f in dataclasses.fields(ConnectorKnobs)}, **OPERATOR_PROFILE}
    from_spec = [name for name in extra if name not in
                 ("maru_index_url", "maru_sidecar_socket", "maru_token_file", "maru_cache_name")]
    assert len(from_spec) == 6
    # The format in its older spelling, which every release's connector reads (docs/operator.md).
    assert "maru_format" not in extra and extra["maru_use_layerwise"] is False
    from_spec = ["maru_format" if name == "maru_use_layerwise" else name for name in from_spec]
    assert {name: getattr(cfg, name) for name in from_spec} == {name: expected[name] for name in from_spec}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_pods_of_an_earlier_operator_keep_a_config_naming_the_token_and_nothing_else_differs(spec):
    """An injected pod reads its pod's credential (the sidecar writes it); the key pods injected by an
    earlier operator read, again at every restart of their vLLM container, still names the cache token
    they mount (their sidecar may write no credential). The two configs differ in nothing else."""
    body = {"metadata": {"name": "c", "namespace": "ns", "uid": "u"},
            "spec": {"pool": {"deviceClass": "shm", "size": "1Gi"}, **spec}}
    ref, parsed = parse_cache(body)
    data = desired.config_map(ref, parsed, SHM)["data"]
    assert desired.CONFIG_KEY == "kv-transfer-config.json"  # the key older pods' specs name
    pods, older_pods = (json.loads(data[key]) for key in (desired.CREDENTIAL_CONFIG_KEY, desired.CONFIG_KEY))
    assert parse_config(pods["kv_connector_extra_config"]).maru_token_file == desired.CREDENTIAL_FILE
    assert parse_config(older_pods["kv_connector_extra_config"]).maru_token_file == desired.TOKEN_FILE
    older_pods["kv_connector_extra_config"]["maru_token_file"] = desired.CREDENTIAL_FILE
    assert older_pods == pods
