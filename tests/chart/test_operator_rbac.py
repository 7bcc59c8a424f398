"""The operator, started from the chart's args and TLS Secret, through a cache's whole life against
kmock: every API call it makes must be granted by the chart's ClusterRole, which grants nothing more
and no wildcard; the API server's view of the webhook (the chart's caBundle and Service name) works."""

from __future__ import annotations

import base64
import json

import pytest
import urllib3
from chart_operator import CACHES, OperatorRun, wait_for
from helm_tools import NAMESPACE, find, one, operator_cluster_role

# Granted although a run against kmock cannot show the call: the API server checks it when an owner
# reference has blockOwnerDeletion (the operator's children have), kmock does not.
GRANTED_WITHOUT_A_CALL = {("maru.io", "marucaches/finalizers", "update")}


def rbac_request(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) the API server authorises a request as; None for discovery."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis":
        group, rest = parts[1] if len(parts) > 1 else "", parts[3:]
    else:
        return None  # /version, /healthz: non-resource URLs every authenticated user may read
    if not rest:
        return None
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete" if named else "deletecollection"}.get(method)
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "1") else "get" if named else "list"
    return group, resource, verb


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


def admission(run: OperatorRun, pod: dict) -> dict:
    """An AdmissionReview over HTTPS, trusting only the chart's caBundle and checking the Service's name."""
    pool = urllib3.HTTPSConnectionPool("127.0.0.1", int(run.webhook_url.split(":")[2].split("/")[0]),
                                       cert_reqs="CERT_REQUIRED", ca_certs=str(run.ca_file),
                                       server_hostname=run.webhook_host, assert_hostname=run.webhook_host)
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "chart-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                          "resource": {"group": "", "version": "v1", "resource": "pods"},
                          "namespace": "default", "operation": "CREATE", "object": pod,
                          "userInfo": {"username": "system:serviceaccount:default:deployer"}, "dryRun": False}}
    path = one(run.docs, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["service"]["path"]
    resp = pool.request("POST", path, body=json.dumps(review), headers={"Content-Type": "application/json"})
    assert resp.status == 200, resp.data[:500]
    return json.loads(resp.data)["response"]


def cache_condition(run: OperatorRun, name: str, kind: str) -> dict | None:
    body = run.kube("GET", f"{CACHES.format(ns='default')}/{name}") or {}
    return next((c for c in (body.get("status") or {}).get("conditions") or () if c["type"] == kind), None)


def a_cache_lifetime(run: OperatorRun) -> None:
    """Create (its first status write conflicting), become Ready, change the spec, inject a pod,
    refuse a bad spec, delete."""
    caches = CACHES.format(ns="default")
    # A status write that conflicts is re-read (GET) and written again; one cache alone rarely races,
    # so the API server answers the first status write with 409 as it would under contention.
    run.cluster.call(lambda: run.cluster.emulator.fail("PATCH", "/marucaches/life/status", 409))
    run.kube("POST", caches, {"apiVersion": "maru.io/v1alpha1", "kind": "MaruCache",
                              "metadata": {"name": "life", "namespace": "default"},
                              "spec": {"pool": {"deviceClass": "dax", "size": "2Gi"}}})
    wait_for(lambda: run.kube("GET", "/apis/apps/v1/namespaces/default/deployments/life-maru-index"),
             what="index Deployment")
    run.kube("PATCH", "/apis/apps/v1/namespaces/default/deployments/life-maru-index/status",
             {"status": {"availableReplicas": 1, "readyReplicas": 1, "replicas": 1}}, "application/merge-patch+json")
    wait_for(lambda: (cache_condition(run, "life", "Ready") or {}).get("status") == "True", what="Ready")
    # A new index port changes every child: config map, Deployment, Service and NetworkPolicy are patched.
    run.kube("PATCH", f"{caches}/life", {"spec": {"storage": {"chunkTokens": 128}, "index": {"port": 7171}}},
             "application/merge-patch+json")
    wait_for(lambda: 7171 in [p["port"] for p in run.kube(
        "GET", "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/life-maru-index")["spec"]["ingress"][0][
        "ports"]], what="network policy updated")
    def chunk_tokens() -> int:
        data = run.kube("GET", "/api/v1/namespaces/default/configmaps/life-maru-config")["data"]
        return json.loads(data["kv-transfer-config.json"])["kv_connector_extra_config"]["maru_kv_chunk_tokens"]
    wait_for(lambda: chunk_tokens() == 128, what="config map updated")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "vllm-0", "namespace": "default", "labels": {"maru.io/cache": "life"}},
           "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}
    answer = wait_for(lambda: (a := admission(run, pod)).get("patch") and "maru-sidecar" in base64.b64decode(
        a["patch"]).decode() and a, what="sidecar injected")
    assert answer["allowed"] is True and answer["uid"] == "chart-1"
    run.kube("POST", caches, {"apiVersion": "maru.io/v1alpha1", "kind": "MaruCache",
                              "metadata": {"name": "bad", "namespace": "default"},
                              "spec": {"pool": {"deviceClass": "pmem", "size": "1Gi"}}})
    wait_for(lambda: (cache_condition(run, "bad", "ConfigValid") or {}).get("status") == "False", what="invalid")
    for name in ("life", "bad"):
        run.kube("DELETE", f"{caches}/{name}")
    wait_for(lambda: run.kube("GET", f"{caches}/life") is None and run.kube("GET", f"{caches}/bad") is None,
             what="finalizers removed")


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
