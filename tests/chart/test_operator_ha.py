"""Several operator replicas from the chart: leader election flags and the Lease's name, the Role
that grants it, and a disruption budget that never blocks a node drain."""

from __future__ import annotations

import argparse

import pytest
from helm_tools import HelmFailed, find, one, operator_args, render

from maru_operator.cli import add_arguments, options_from_args


def parsed(docs):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return options_from_args(parser.parse_args(operator_args(docs)))


def test_the_operator_is_elected_by_a_lease_named_in_its_role(tmp_path):
    docs = render(tmp_path)
    options = parsed(docs)
    assert options.leader_election and options.lease_seconds == 15
    assert options.lease_name == one(docs, "Deployment")["metadata"]["name"]
    (role,) = find(docs, "Role")
    assert any(options.lease_name in rule.get("resourceNames", ()) for rule in role["rules"])
    env = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in env
    custom = parsed(render(tmp_path, {"operator": {"leaderElection": {"leaseName": "ours", "leaseSeconds": 30}}}))
    assert (custom.lease_name, custom.lease_seconds) == ("ours", 30)
    off = render(tmp_path, {"operator": {"leaderElection": {"enabled": False}}})
    assert not parsed(off).leader_election and not find(off, "Role")


def test_two_replicas_get_a_budget_that_lets_a_drain_evict_one_at_a_time(tmp_path):
    assert not find(render(tmp_path), "PodDisruptionBudget"), "one replica: nothing to keep"
    docs = render(tmp_path, {"operator": {"replicas": 2}})
    (budget,) = find(docs, "PodDisruptionBudget")
    assert budget["spec"] == {"maxUnavailable": 1, "selector": budget["spec"]["selector"]}
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items() and selector["app.kubernetes.io/component"] == "operator"


def test_several_replicas_without_leader_election_are_refused(tmp_path):
    with pytest.raises(HelmFailed, match=r"replicas > 1 needs operator.leaderElection.enabled"):
        render(tmp_path, {"operator": {"replicas": 3, "leaderElection": {"enabled": False}}})
