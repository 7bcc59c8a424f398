"""The connector against the connector API of the vLLM it runs in.

``make test`` runs this file with the pinned CPU build and again with the
newest vLLM release it pins (``scripts/test_vllm_release.sh``), so a moved
base-class method, a renamed module or a new abstract method shows up here
by name rather than as a crash inside an engine.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

import maru_connector
from maru_connector.connector import MaruKVConnector

PACKAGE = Path(maru_connector.__file__).parent


def _type_checking_imports():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                for stmt in node.body:
                    if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.startswith("vllm"):
                        for alias in stmt.names:
                            yield f"{path.name}: {stmt.module}.{alias.name}"


@pytest.mark.parametrize("name", list(_type_checking_imports()))
def test_type_checking_imports_exist_in_this_vllm(name):
    """A type checker run against this vLLM resolves every name we annotate with."""
    module, _, attr = name.split(": ")[1].rpartition(".")
    assert hasattr(importlib.import_module(module), attr), f"vLLM {vllm.__version__} has no {module}.{attr}"


def test_no_abstract_method_is_left_unimplemented():
    assert not getattr(MaruKVConnector, "__abstractmethods__", frozenset())


OVERRIDDEN = sorted(
    name for name, value in vars(MaruKVConnector).items()
    if callable(getattr(value, "__func__", value)) and not name.startswith("_") and hasattr(KVConnectorBase_V1, name)
)


@pytest.mark.parametrize("name", OVERRIDDEN)
def test_overridden_methods_take_what_vllm_passes(name):
    """Every base-class method we override accepts the parameters vLLM's
    signature names, in order (vLLM calls some by keyword)."""
    ours = inspect.signature(getattr(MaruKVConnector, name))
    base = inspect.signature(getattr(KVConnectorBase_V1, name))
    ours_params = [p.name for p in ours.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    base_params = [p.name for p in base.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert ours_params == base_params, f"vLLM {vllm.__version__}: {name}{base} but ours is {name}{ours}"
