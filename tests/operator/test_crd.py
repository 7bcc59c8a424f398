"""The CRD: schema validity, examples, defaults, CEL rules, and the generated manifests."""

import copy
import json
import pathlib
import subprocess
import sys

import celpy
import jsonschema
import pytest
import yaml

from kube_helpers import CRD_PATH, EXAMPLES, apply_defaults, crd_schema
from maru_operator import desired
from maru_operator.inventory import Device
from maru_operator.ledger import Ledger
from maru_operator.models import parse_cache

VALIDATE = [str(pathlib.Path(sys.executable).with_name("kubernetes-validate")), "--strict", "--quiet"]


def test_crd_passes_kubernetes_validate_strict():
    run = subprocess.run(VALIDATE + [str(CRD_PATH)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_crds_folder_holds_only_the_definition():
    assert sorted(p.name for p in CRD_PATH.parent.glob("*.yaml")) == ["marucache.yaml"]
    assert {p.name for p in EXAMPLES} == {"minimal.yaml", "complete.yaml"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_schema(example):
    obj = yaml.safe_load(example.read_text())
    jsonschema.Draft7Validator(crd_schema()).validate(apply_defaults(crd_schema(), obj))


def test_schema_rejects_typos_of_known_shapes():
    schema = crd_schema()
    bad = yaml.safe_load(EXAMPLES[0].read_text())
    bad["spec"]["pool"]["size"] = "sixty gigs"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)
    bad = yaml.safe_load(EXAMPLES[0].read_text())
    bad["spec"]["storage"] = {"layout": "rowwise"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)


def test_schema_defaults_equal_the_operators_defaults():
    """kmock does not default: the operator applies the same defaults the API server would."""
    for example in EXAMPLES:
        obj = yaml.safe_load(example.read_text())
        assert parse_cache(apply_defaults(crd_schema(), obj)) == parse_cache(obj)


def _rules(schema, path=()):
    for rule in schema.get("x-kubernetes-validations") or ():
        yield path, rule
    for key, sub in (schema.get("properties") or {}).items():
        yield from _rules(sub, path + (key,))


def _eval(rule, value, old=None):
    env = celpy.Environment()
    program = env.program(env.compile(rule["rule"]))
    activation = {"self": celpy.json_to_cel(value)}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    return bool(program.evaluate(activation))


def _at(obj, path):
    for key in path:
        obj = obj[key]
    return obj


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_cel_rules_compile_and_admit_the_examples(example):
    obj = apply_defaults(crd_schema(), yaml.safe_load(example.read_text()))
    rules = list(_rules(crd_schema()))
    assert len(rules) >= 4
    for path, rule in rules:
        value = _at(obj, path)
        assert _eval(rule, value, old=value), rule["rule"]


def test_cel_rules_refuse_what_they_describe():
    obj = apply_defaults(crd_schema(), yaml.safe_load(EXAMPLES[0].read_text()))
    rules = {rule["rule"]: (path, rule) for path, rule in _rules(crd_schema())}
    long_name = copy.deepcopy(obj)
    long_name["metadata"]["name"] = "x" * 53
    assert not _eval(rules["size(self.metadata.name) <= 52"][1], long_name)
    watermarks = dict(obj["spec"]["eviction"], lowWatermark=0.96)
    assert not _eval(rules["self.lowWatermark < self.highWatermark"][1], watermarks)
    assert not _eval(rules["self.port != self.metricsPort"][1], dict(obj["spec"]["index"], metricsPort=7070))
    assert not _eval(rules["self == oldSelf"][1], "dax", old="shm")


def test_generated_children_pass_kubernetes_validate_strict(tmp_path):
    for example in EXAMPLES:
        body = yaml.safe_load(example.read_text())
        body["metadata"]["uid"] = "0b6f2a7e-uid"
        ref, spec = parse_cache(body)
        device = Device("cxl-a" if spec.pool.device_class == "dax" else "shm:n1", spec.pool.device_class,
                        256 << 30, {"n1": "/dev/dax0.0" if spec.pool.device_class == "dax" else "/dev/shm/marucache"})
        _, claim = Ledger().allocate(ref, spec.pool.device_class, spec.pool.size, [device])
        placement = desired.place(ref, claim, device)
        docs = desired.children(ref, spec, placement) + [desired.token_secret(ref, "t0k3n")]
        path = tmp_path / f"{example.stem}-children.yaml"
        path.write_text(yaml.safe_dump_all(docs))
        run = subprocess.run(VALIDATE + [str(path)], capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
        config = json.loads(docs[0]["data"][desired.CONFIG_KEY])
        assert config["kv_load_failure_policy"] == "recompute"
        assert config["kv_connector_extra_config"]["maru_kv_chunk_tokens"] == spec.storage.chunk_tokens
