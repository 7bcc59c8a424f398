"""Namespace users' access to MaruCaches through Kubernetes' default roles (view, edit, admin),
computed from the rendered chart the way the API server's aggregation controller does."""

from __future__ import annotations

from typing import Any

import pytest
from helm_tools import find, operator_cluster_role, render

AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-{}"
READ = {"get", "list", "watch"}
WRITE = {"create", "update", "patch", "delete", "deletecollection"}
# Kubernetes' own default roles aggregate each other: view's rules flow into edit, edit's into admin.
BUILT_IN_CHAIN = {"view": (), "edit": ("view",), "admin": ("edit",)}


def aggregated(docs: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    """The rules the chart adds to the default ClusterRole `role` (with those of the roles it aggregates)."""
    rules = [rule for d in find(docs, "ClusterRole") if d["metadata"]["labels"].get(AGGREGATE.format(role)) == "true"
             for rule in d["rules"]]
    for inner in BUILT_IN_CHAIN[role]:
        rules += aggregated(docs, inner)
    return rules


def verbs(rules: list[dict[str, Any]], resource: str) -> set[str]:
    return {verb for rule in rules if "maru.io" in rule["apiGroups"] and resource in rule["resources"]
            for verb in rule["verbs"]}


def test_view_reads_marucaches_and_changes_nothing(tmp_path):
    rules = aggregated(render(tmp_path), "view")
    assert verbs(rules, "marucaches") == READ
    assert verbs(rules, "marucaches/status") == READ
    assert all(set(r["verbs"]) <= READ for r in rules), rules


@pytest.mark.parametrize("role", ["edit", "admin"])
def test_edit_and_admin_manage_marucaches_but_never_write_their_status(tmp_path, role):
    rules = aggregated(render(tmp_path), role)
    assert verbs(rules, "marucaches") == READ | WRITE
    assert verbs(rules, "marucaches/status") == READ  # the status is the operator's
    assert not verbs(rules, "marucaches/finalizers")


def test_the_user_roles_grant_only_marucaches_and_no_wildcards(tmp_path):
    docs = render(tmp_path)
    operator = operator_cluster_role(docs)["metadata"]["name"]
    users = [d for d in find(docs, "ClusterRole") if d["metadata"]["name"] != operator]
    assert len(users) == 2
    for role in users:
        assert any(k.startswith(AGGREGATE.format("")) for k in role["metadata"]["labels"]), role["metadata"]
        for rule in role["rules"]:
            assert rule["apiGroups"] == ["maru.io"] and "*" not in rule["verbs"] + rule["resources"], rule
    bound = {b["roleRef"]["name"] for kind in ("ClusterRoleBinding", "RoleBinding") for b in find(docs, kind)}
    assert bound == {operator}, "the user roles act only through the default roles' own bindings"


def test_the_aggregation_can_be_turned_off(tmp_path):
    docs = render(tmp_path, {"rbac": {"aggregateToDefaultRoles": False}})
    assert [d["metadata"]["name"] for d in find(docs, "ClusterRole")] == [operator_cluster_role(docs)["metadata"]["name"]]
    assert not find(render(tmp_path, {"rbac": {"create": False}}), "ClusterRole")
