"""The operator, started from the chart's args and TLS Secret, through a cache's whole life against
kmock: every API call it makes must be granted by the chart's ClusterRole, which grants nothing more
and no wildcard; the API server's view of the webhook (the chart's caBundle and Service name) works."""

from __future__ import annotations

import pytest
import urllib3
from chart_operator import OperatorRun, a_cache_lifetime, wait_for
from helm_tools import NAMESPACE, find, one, operator_cluster_role
from rbac_check import rbac_request

# Granted although a run against kmock cannot show the call: the API server checks it when an owner
# reference has blockOwnerDeletion (the operator's children have), kmock does not.
GRANTED_WITHOUT_A_CALL = {("maru.io", "marucaches/finalizers", "update")}


def granted(docs: list[dict]) -> set[tuple[str, str, str]]:
    """What the operator's ClusterRole grants, and its Role in the release namespace (the leader
    election Lease, by name: `test_the_lease_calls_name_the_granted_lease` checks the names)."""
    cluster_rules = operator_cluster_role(docs)["rules"]
    rules = cluster_rules + [rule for role in find(docs, "Role") for rule in role["rules"]]
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], f"wildcard in {key}: {rule}"
        assert "nonResourceURLs" not in rule, rule
    assert not any("resourceNames" in rule for rule in cluster_rules)
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


@pytest.fixture(scope="module")
def calls(operator_run: OperatorRun) -> set[tuple[str, str, str]]:
    a_cache_lifetime(operator_run)
    # The leader renews its Lease every 2/15 of --lease-seconds: wait for one renewal to be recorded.
    wait_for(lambda: any(method == "PATCH" and "/leases/" in path for method, path, _ in operator_run.operator_calls()),
             timeout=10, what="a Lease renewal")
    return {req for call in operator_run.operator_calls() if (req := rbac_request(*call)) is not None}


def test_the_cluster_role_grants_every_call_the_operator_makes(operator_run: OperatorRun, calls):
    # The lifetime really exercised the operator: children created and patched, status, events, watches.
    assert {("apps", "deployments", "create"), ("apps", "deployments", "watch"), ("", "configmaps", "patch"),
            ("maru.io", "marucaches/status", "patch"), ("maru.io", "marucaches", "patch"),
            ("", "events", "create"), ("", "nodes", "watch"), ("", "secrets", "create")} <= calls, sorted(calls)
    missing = calls - granted(operator_run.docs)
    assert not missing, f"the operator made calls the chart's ClusterRole does not grant: {sorted(missing)}"


def test_the_cluster_role_grants_nothing_the_operator_does_not_use(operator_run: OperatorRun, calls):
    unused = granted(operator_run.docs) - calls - GRANTED_WITHOUT_A_CALL
    assert not unused, f"granted but never used (least privilege): {sorted(unused)}"


def test_the_lease_calls_name_the_granted_lease(operator_run: OperatorRun, calls):
    assert {("coordination.k8s.io", "leases", "get"), ("coordination.k8s.io", "leases", "patch")} <= calls
    (role,) = find(operator_run.docs, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    (named,) = [rule["resourceNames"] for rule in role["rules"] if "resourceNames" in rule]
    leases = [path for _, path, _ in operator_run.operator_calls() if "/leases" in path]
    prefix = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"
    assert leases and all(path == prefix or path.removeprefix(prefix + "/") in named for path in leases), leases


def test_the_cluster_role_is_bound_to_the_operators_service_account(operator_run: OperatorRun):
    docs = operator_run.docs
    binding = one(docs, "ClusterRoleBinding")
    account = one(docs, "ServiceAccount")["metadata"]
    assert binding["roleRef"]["name"] == operator_cluster_role(docs)["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                    "namespace": account["namespace"]}]
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]


def test_the_webhook_refuses_clients_that_do_not_trust_the_chart_ca(operator_run: OperatorRun):
    port = int(operator_run.webhook_url.split(":")[2].split("/")[0])
    untrusting = urllib3.HTTPSConnectionPool("127.0.0.1", port, cert_reqs="CERT_REQUIRED", retries=False,
                                             server_hostname=operator_run.webhook_host)
    with pytest.raises(urllib3.exceptions.SSLError):
        untrusting.request("POST", "/inject", body=b"{}")
    wrong_name = urllib3.HTTPSConnectionPool("127.0.0.1", port, cert_reqs="CERT_REQUIRED", retries=False,
                                             ca_certs=str(operator_run.ca_file), server_hostname="other.svc",
                                             assert_hostname="other.svc")
    with pytest.raises(urllib3.exceptions.SSLError):
        wrong_name.request("POST", "/inject", body=b"{}")
