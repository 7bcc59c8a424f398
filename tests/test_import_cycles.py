"""No module of a product package imports, even only for type checking, a
module that imports it back (directly or through others). The import
contract (pyproject.toml, run by `make test`) holds the edges between the
packages; this holds the edges inside each."""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ["maru_core", "maru_connector", "maru_sidecar", "maru_operator"]


def cycles_in(package: str) -> list[tuple[str, str]]:
    graph = grimp.build_graph(package)
    found = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.chain_exists(importer=imported, imported=module):
                found.add(tuple(sorted((module, imported))))
    return sorted(found)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_one_that_imports_it_back(package):
    assert cycles_in(package) == [], "move what both need into a module of its own"
