"""The chart with operator.watchNamespaces: a Role per namespace instead of cluster-wide rules on
namespaced resources, a ClusterRole that only reads nodes, the webhook and monitors limited to those
namespaces; and the operator started from that chart against kmock, whose every API call the scoped
rules allow (evaluated as the API server would: kmock itself authorises nothing), reconciling the
caches of a listed namespace and never touching another namespace."""

from __future__ import annotations

import pytest
import yaml
from chart_operator import CACHES, OperatorRun, a_cache_lifetime, chart_operator, wait_for
from helm_tools import CHART, NAMESPACE, HelmFailed, find, helm, one, operator_args, \
    operator_cluster_role, render
from rbac_check import Authorizer, Request, parse_request

WATCHED = ["team-a", "team-b"]
SCOPED = {"operator": {"watchNamespaces": WATCHED}}
OUTSIDE = "elsewhere"  # a namespace the operator does not serve
CLUSTER_SCOPED = {("", "nodes"), ("apiextensions.k8s.io", "customresourcedefinitions")}
# Granted although a run against kmock cannot show the call (test_operator_rbac.py says why).
GRANTED_WITHOUT_A_CALL = {("maru.io", "marucaches/finalizers", "update")}


def operator_roles(docs: list[dict]) -> dict[str, dict]:
    """The operator's Roles on caches, by namespace."""
    return {r["metadata"]["namespace"]: r for r in find(docs, "Role") if r["metadata"]["name"].endswith("-caches")}


def authorizer(docs: list[dict]) -> Authorizer:
    account = one(docs, "ServiceAccount")["metadata"]
    return Authorizer(docs, account["namespace"], account["name"])


def test_helm_lint_strict_passes_with_watch_namespaces(tmp_path):
    # (kubernetes-validate --strict of the same values: test_chart_render.py, DOCUMENTED)
    values = tmp_path / "scoped.yaml"
    values.write_text(yaml.safe_dump({**SCOPED, "webhook": {"namespaceSelector": {"matchLabels": {"a": "b"}}},
                                      "monitoring": {"serviceMonitor": {"enabled": True}}}))
    assert "0 chart(s) failed" in helm("lint", str(CHART), "--strict", "--namespace", NAMESPACE, "--values", str(values))


def test_namespaced_rules_are_roles_in_each_watched_namespace_and_the_cluster_role_reads_only_nodes(tmp_path):
    docs = render(tmp_path, SCOPED)
    cluster_rules = operator_cluster_role(docs)["rules"]
    assert {(g, r) for rule in cluster_rules for g in rule["apiGroups"] for r in rule["resources"]} <= CLUSTER_SCOPED
    assert cluster_rules == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}]
    roles = operator_roles(docs)
    assert sorted(roles) == WATCHED
    # Each Role holds exactly the namespaced rules the cluster-wide ClusterRole grants.
    cluster_wide = [r for r in operator_cluster_role(render(tmp_path))["rules"]
                    if not {(g, res) for g in r["apiGroups"] for res in r["resources"]} <= CLUSTER_SCOPED]
    for namespace, role in roles.items():
        assert role["rules"] == cluster_wide, namespace
    account = one(docs, "ServiceAccount")["metadata"]
    bindings = {b["metadata"]["namespace"]: b for b in find(docs, "RoleBinding")
                if b["roleRef"]["name"].endswith("-caches")}
    assert sorted(bindings) == WATCHED
    for binding in bindings.values():
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                        "namespace": account["namespace"]}]
    # The ledger ConfigMap in the release namespace, by name (create cannot be limited to one).
    (ledger,) = [r for r in find(docs, "Role") if r["metadata"]["name"].endswith("-ledger")]
    assert ledger["metadata"]["namespace"] == NAMESPACE
    assert [r.get("resourceNames") for r in ledger["rules"]] == [None, ["marucache-ledger"]]
    assert [a for a in operator_args(docs) if a.startswith("--watch-namespace")] == [
        "--watch-namespace=team-a", "--watch-namespace=team-b"]
    # A list of every namespace's caches, or another namespace's pods, is denied.
    auth = authorizer(docs)
    assert not auth.allows(Request("maru.io", "marucaches", "list", None, None))
    assert not auth.allows(Request("", "pods", "watch", OUTSIDE, None))
    assert auth.allows(Request("", "pods", "watch", "team-b", None))


def test_without_watch_namespaces_the_chart_stays_cluster_wide(tmp_path):
    docs = render(tmp_path)
    assert not operator_roles(docs) and not [r for r in find(docs, "Role") if r["metadata"]["name"].endswith("-ledger")]
    assert not [a for a in operator_args(docs) if a.startswith("--watch-namespace")]
    assert "namespaceSelector" not in one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    auth = authorizer(docs)
    assert auth.allows(Request("maru.io", "marucaches", "watch", None, None))
    assert auth.allows(Request("", "pods", "list", None, None))


def test_the_webhook_is_sent_only_the_watched_namespaces_pods(tmp_path):
    hook = one(render(tmp_path, SCOPED), "MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": WATCHED}]}
    # A selector of the user's own is kept: both must match.
    mine = {"matchLabels": {"maru.io/inject": "enabled"},
            "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["system"]}]}
    hook = one(render(tmp_path, {**SCOPED, "webhook": {"namespaceSelector": mine}}),
               "MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["namespaceSelector"] == {"matchLabels": mine["matchLabels"], "matchExpressions": [
        *mine["matchExpressions"], {"key": "kubernetes.io/metadata.name", "operator": "In", "values": WATCHED}]}


def test_monitors_of_indexes_and_sidecars_look_only_in_the_watched_namespaces(tmp_path):
    for kind, monitoring in (("PodMonitor", {"podMonitor": {"enabled": True}}),
                             ("ServiceMonitor", {"serviceMonitor": {"enabled": True}})):
        monitors = find(render(tmp_path, {**SCOPED, "monitoring": monitoring}), kind)
        selectors = [m["spec"].get("namespaceSelector") for m in monitors]
        assert selectors.count({"matchNames": WATCHED}) == 2, selectors  # index and sidecar
        selectors = [m["spec"].get("namespaceSelector") for m in find(render(tmp_path, {"monitoring": monitoring}),
                                                                      kind)]
        assert selectors.count({"any": True}) == 2, selectors


@pytest.mark.parametrize("names, message", [
    (["Team_A"], "watchNamespaces"), (["team-a", "team-a"], "unique"), ([""], "watchNamespaces")])
def test_the_schema_refuses_what_is_not_a_list_of_namespace_names(tmp_path, names, message):
    with pytest.raises(HelmFailed) as exc:
        render(tmp_path, {"operator": {"watchNamespaces": names}})
    assert message in exc.value.stderr


# The operator of the scoped chart (the release namespace maru-system is not one of WATCHED).


@pytest.fixture(scope="module")
def scoped_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("scoped-operator")
    with chart_operator(render(tmp, SCOPED), tmp) as run:
        yield run


@pytest.fixture(scope="module")
def scoped_calls(scoped_run: OperatorRun) -> list[Request]:
    """A cache's whole life in a watched namespace, beside a cache in a namespace that is not watched."""
    run = scoped_run
    run.kube("POST", CACHES.format(ns=OUTSIDE), {"apiVersion": "maru.io/v1alpha1", "kind": "MaruCache",
                                                 "metadata": {"name": "ignored", "namespace": OUTSIDE},
                                                 "spec": {"pool": {"deviceClass": "dax", "size": "2Gi"}}})
    a_cache_lifetime(run, "team-a")
    wait_for(lambda: any(m == "PATCH" and "/leases/" in p for m, p, _ in run.operator_calls()), timeout=10,
             what="a Lease renewal")
    return [req for call in run.operator_calls() if (req := parse_request(*call)) is not None]


def test_the_scoped_rules_allow_every_call_of_the_scoped_operator(scoped_run, scoped_calls):
    kinds = {(r.group, r.resource, r.verb) for r in scoped_calls}
    assert {("apps", "deployments", "create"), ("", "configmaps", "patch"), ("maru.io", "marucaches", "watch"),
            ("maru.io", "marucaches/status", "patch"), ("", "events", "create"), ("", "nodes", "watch"),
            ("coordination.k8s.io", "leases", "patch")} <= kinds, sorted(kinds)
    auth = authorizer(scoped_run.docs)
    denied = sorted({r for r in scoped_calls if not auth.allows(r)}, key=str)
    assert not denied, f"the scoped operator made calls its Roles and ClusterRole do not allow: {denied}"
    unused = auth.granted() - kinds - GRANTED_WITHOUT_A_CALL
    assert not unused, f"granted but never used (least privilege): {sorted(unused)}"


def test_the_scoped_operator_lists_and_watches_no_namespaced_resource_across_namespaces(scoped_calls):
    across = {(r.group, r.resource, r.verb) for r in scoped_calls
              if r.namespace is None and (r.group, r.resource) not in CLUSTER_SCOPED}
    assert not across, across
    assert {r.namespace for r in scoped_calls} <= {None, *WATCHED, NAMESPACE}


def test_a_cache_outside_the_watched_namespaces_is_not_touched(scoped_run, scoped_calls):
    body = scoped_run.kube("GET", f"{CACHES.format(ns=OUTSIDE)}/ignored")
    assert not body["metadata"].get("finalizers") and not body.get("status") and \
        not body["metadata"].get("annotations"), body
    assert not [r for r in scoped_calls if r.namespace == OUTSIDE]
    assert scoped_run.kube("GET", f"/api/v1/namespaces/{OUTSIDE}/configmaps/ignored-maru-config") is None
