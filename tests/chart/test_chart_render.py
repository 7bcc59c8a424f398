"""The chart rendered by the real helm: lint, strict validation, schema, exclusivity, CRD copy,
names, the operator's flags, the webhook and its generated TLS, dashboards, and the alert rules."""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import shutil
import subprocess

import pytest
import yaml
from chart_files import CRD_SOURCE, CRD_TEMPLATE, crd_template
from cryptography import x509
from helm_tools import (ALL_FEATURES, ALL_FEATURES_SM, CHART, KUBERNETES_VALIDATE, NAMESPACE, HelmFailed, alert_rules,
                        find, helm, one, operator_args, render)

from maru_operator.cli import add_arguments, options_from_args

BUILT_IN_GROUPS = ("v1", "apps/", "rbac.authorization.k8s.io/", "admissionregistration.k8s.io/",
                   "apiextensions.k8s.io/", "policy/")
PROMTOOL = shutil.which("promtool")


def test_helm_lint_passes_with_defaults_and_with_every_feature(tmp_path):
    assert "0 chart(s) failed" in helm("lint", str(CHART), "--strict", "--namespace", NAMESPACE)
    for i, values in enumerate((ALL_FEATURES, ALL_FEATURES_SM)):
        path = tmp_path / f"lint-{i}.yaml"
        path.write_text(yaml.safe_dump(values))
        assert "0 chart(s) failed" in helm("lint", str(CHART), "--strict", "--values", str(path))


# Every values combination the docs show (docs/helm.md, docs/install.md), besides the defaults.
DOCUMENTED = {
    "install-md": {"operator": {"image": {"repository": "registry.example.com/ml/marucache"}},
                   "devicePlugin": {"enabled": True}},
    "tls-secret-with-ca": {"webhook": {"tls": {"mode": "secret", "secretName": "mine",
                                               "caBundle": base64.b64encode(b"-----BEGIN CERTIFICATE-----\n")
                                               .decode()}}},
    "tls-secret-cert-manager": {"webhook": {"tls": {"mode": "secret", "secretName": "mine"},
                                            "annotations": {"cert-manager.io/inject-ca-from": "maru-system/c"}}},
    "plain-sidecars-no-usage": {"operator": {"nativeSidecars": "never", "usageSeconds": 0}},
    "tls-cert-manager": {"webhook": {"tls": {"mode": "certManager"}}},
    "watch-namespaces": {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
    "tls-cert-manager-cluster-issuer": {"webhook": {"tls": {"mode": "certManager", "certManager": {
        "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}}},
}
CERT_MANAGER_KINDS = {"Certificate", "Issuer"}


@pytest.mark.parametrize("values", [{}, ALL_FEATURES, ALL_FEATURES_SM, {"operator": {"replicas": 2}},
                                    {"webhook": {"enabled": False}, "crds": {"enabled": False},
                                     "dashboards": {"enabled": False}}, *DOCUMENTED.values()],
                         ids=["defaults", "every-feature-podmonitor", "every-feature-servicemonitor", "two-replicas",
                              "minimal",
                              *DOCUMENTED])
def test_every_built_in_manifest_passes_kubernetes_validate_strict(tmp_path, values):
    docs = render(tmp_path, values)
    built_in = [d for d in docs if d["apiVersion"].startswith(BUILT_IN_GROUPS)]
    assert len(built_in) >= 5
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(built_in))
    run = subprocess.run([KUBERNETES_VALIDATE, "--strict", "--quiet", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    # Everything else is a Prometheus Operator kind (validated by promtool and a real Prometheus below).
    others = {d["kind"] for d in docs} - {d["kind"] for d in built_in}
    # cert-manager's kinds are checked field by field in the cert-manager test below.
    assert others <= {"ServiceMonitor", "PodMonitor", "PrometheusRule", *CERT_MANAGER_KINDS}, others


def test_every_feature_renders_what_it_promises(tmp_path):
    kinds = [d["kind"] for d in render(tmp_path, ALL_FEATURES)]
    for kind in ("CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                 "Service", "Secret", "MutatingWebhookConfiguration", "PodMonitor", "PrometheusRule"):
        assert kind in kinds, kind
    assert kinds.count("PodMonitor") == 3 and "ServiceMonitor" not in kinds
    sm_kinds = [d["kind"] for d in render(tmp_path, ALL_FEATURES_SM)]
    assert sm_kinds.count("ServiceMonitor") == 3 and "PodMonitor" not in sm_kinds
    minimal = render(tmp_path, {"webhook": {"enabled": False}, "crds": {"enabled": False},
                                "dashboards": {"enabled": False}})
    assert {d["kind"] for d in minimal} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                            "RoleBinding", "Deployment", "Service"}
    assert "--no-webhook" in operator_args(minimal)


@pytest.mark.parametrize("typo, message", [
    ({"operator": {"replicaz": 2}}, "replicaz"),
    ({"webhok": {"enabled": False}}, "webhok"),
    ({"monitoring": {"serviceMonitor": {"enable": True}}}, "enable"),
    ({"webhook": {"tls": {"mode": "certmanager"}}}, "mode"),
    ({"webhook": {"failurePolicy": "ignore"}}, "failurePolicy"),
])
def test_the_schema_rejects_misspelled_keys_and_bad_values(tmp_path, typo, message):
    with pytest.raises(HelmFailed) as failed:
        render(tmp_path, typo)
    assert "values don't meet the specifications of the schema" in failed.value.stderr
    assert message in failed.value.stderr


def test_service_monitor_and_pod_monitor_together_fail_with_a_clear_message(tmp_path):
    both = {"monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    with pytest.raises(HelmFailed) as failed:
        render(tmp_path, both)
    assert "enable only one" in failed.value.stderr


def test_secret_mode_needs_a_secret_and_a_ca(tmp_path):
    with pytest.raises(HelmFailed, match="set webhook.tls.secretName"):
        render(tmp_path, {"webhook": {"tls": {"mode": "secret"}}})
    with pytest.raises(HelmFailed, match="set webhook.tls.caBundle"):
        render(tmp_path, {"webhook": {"tls": {"mode": "secret", "secretName": "mine"}}})
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    docs = render(tmp_path, {"webhook": {"tls": {"mode": "secret", "secretName": "mine", "caBundle": ca}}})
    assert not find(docs, "Secret"), "secret mode must not render a Secret of its own"
    volumes = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"secretName": "mine", "items": [{"key": "tls.crt", "path": "tls.crt"},
                                            {"key": "tls.key", "path": "tls.key"}]} in [v.get("secret") for v in volumes]
    hook = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["clientConfig"]["caBundle"] == ca
    injected = render(tmp_path, {"webhook": {"tls": {"mode": "secret", "secretName": "mine"},
                                             "annotations": {"cert-manager.io/inject-ca-from": "maru-system/c"}}})
    assert "caBundle" not in one(injected, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]


def test_the_templated_crd_is_identical_to_crds_folder(tmp_path):
    assert CRD_TEMPLATE.read_text() == crd_template(), (
        "charts/marucache/templates/crd-marucaches.yaml differs from crds/marucache.yaml: "
        "run python tests/chart/chart_files.py")
    source = yaml.safe_load(CRD_SOURCE.read_text())
    rendered = one(render(tmp_path), "CustomResourceDefinition")
    assert rendered["spec"] == source["spec"]
    assert rendered["metadata"]["name"] == source["metadata"]["name"]
    assert source["metadata"]["labels"].items() <= rendered["metadata"]["labels"].items()
    assert rendered["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    unkept = one(render(tmp_path, {"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "annotations" not in unkept["metadata"]
    assert not find(render(tmp_path, {"crds": {"enabled": False}}), "CustomResourceDefinition")


def test_names_stay_within_63_characters_and_labels_are_valid(tmp_path):
    long_release = "release-" + "x" * 45  # helm's limit: 53 characters
    docs = render(tmp_path, ALL_FEATURES, release=long_release)
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
        assert not doc["metadata"]["name"].endswith("-"), doc["metadata"]["name"]
        for value in (doc["metadata"].get("labels") or {}).values():
            assert len(value) <= 63, value
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), names
    overridden = render(tmp_path, {"fullnameOverride": "maru"})
    assert one(overridden, "Deployment")["metadata"]["name"] == "maru-operator"


def test_the_operator_accepts_the_flags_the_chart_passes(tmp_path):
    """The Deployment's args parse with the operator's own argument parser, and mean what the values say."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    docs = render(tmp_path, ALL_FEATURES)
    options = options_from_args(parser.parse_args(operator_args(docs)))
    service = one(docs, "Service")
    assert options.namespace == NAMESPACE and options.ledger_name == "marucache-ledger"
    assert options.resync_seconds == 7  # extraArgs come last and win
    assert options.webhook and options.webhook_port == 9443 and not options.webhook_manage
    assert options.webhook_host == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert options.webhook_cert_dir == "/etc/marucache/webhook-tls"
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["webhook-tls"] == options.webhook_cert_dir
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": options.metrics_port, "health": 8081, "webhook": options.webhook_port}
    assert options.liveness == "http://0.0.0.0:8081/healthz"
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"webhook": "webhook",
                                                                              "metrics": "metrics"}
    assert container["image"] == options.default_image == "ghcr.io/marucache/marucache:0.1.0"
    digest = "sha256:" + "ab" * 32
    pinned = render(tmp_path, {"operator": {"image": {"digest": digest}}})
    image = one(pinned, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.endswith("@" + digest)
    # Caches that name no image run the operator's own: an upgrade of the chart moves them.
    assert f"--default-image={image}" in operator_args(pinned)


def test_webhook_configuration_matches_what_kopf_would_register(tmp_path):
    """Rules, selector, path and policies equal kopf's own build of the operator's webhook."""
    import kopf
    from kopf._cogs.structs import references
    from kopf._core.engines.admission import build_webhooks

    from maru_operator.webhook import register_webhook

    registry = kopf.OperatorRegistry()
    register_webhook(registry)
    pods = references.Resource(group="", version="v1", plural="pods", kind="Pod", namespaced=True)
    (kopf_hook,) = build_webhooks(registry._webhooks.get_all_handlers(), resources=[pods], name_suffix="x",
                                  client_config={"url": "https://h"})
    (hook,) = one(render(tmp_path), "MutatingWebhookConfiguration")["webhooks"]
    for key in ("rules", "objectSelector", "sideEffects", "failurePolicy", "matchPolicy", "admissionReviewVersions"):
        assert hook[key] == kopf_hook[key], key
    assert hook["clientConfig"]["service"]["path"] == kopf_hook["clientConfig"]["url"].removeprefix("https://h")


def test_generated_webhook_certificate_is_signed_by_the_ca_bundle_and_names_the_service(tmp_path):
    docs = render(tmp_path)
    secret = one(docs, "Secret")
    hook = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    ca = x509.load_pem_x509_certificate(base64.b64decode(hook["clientConfig"]["caBundle"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    assert secret["data"]["ca.crt"] == hook["clientConfig"]["caBundle"]
    cert.verify_directly_issued_by(ca)
    service = hook["clientConfig"]["service"]
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    assert f"{service['name']}.{service['namespace']}.svc" in names
    assert cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc) > datetime.timedelta(days=3000)
    volume = next(v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == "webhook-tls")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]


def test_cert_manager_issues_the_secret_the_operator_mounts_and_injects_its_ca(tmp_path):
    """mode certManager: the serving Certificate goes into the Secret the operator mounts and names
    the Service the API server calls; cert-manager injects the CA the Certificate's issuer chain
    ends in; nothing is generated at render time, so a GitOps `helm template` renders the same
    manifests every time (mode "generate" makes a new CA on each render there)."""
    values = DOCUMENTED["tls-cert-manager"]
    docs = render(tmp_path, values)
    assert render(tmp_path, values) == docs
    assert render(tmp_path) != render(tmp_path), "generate mode no longer differs between renders"
    assert not find(docs, "Secret")
    certs = {d["metadata"]["name"]: d for d in find(docs, "Certificate")}
    issuers = {d["metadata"]["name"]: d for d in find(docs, "Issuer")}
    assert all(d["apiVersion"] == "cert-manager.io/v1" for d in [*certs.values(), *issuers.values()])
    volume = next(v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == "webhook-tls")
    serving = next(c for c in certs.values() if c["spec"]["secretName"] == volume["secret"]["secretName"])
    config = one(docs, "MutatingWebhookConfiguration")
    service = config["webhooks"][0]["clientConfig"]["service"]
    assert f"{service['name']}.{service['namespace']}.svc" in serving["spec"]["dnsNames"]
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"{NAMESPACE}/{serving['metadata']['name']}"
    # The chain: serving <- CA Issuer <- its CA Certificate's Secret <- a self-signed Issuer.
    ca_issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    assert serving["spec"]["issuerRef"]["kind"] == "Issuer"
    ca_cert = next(c for c in certs.values() if c["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"])
    assert ca_cert["spec"]["isCA"] is True
    assert "selfSigned" in issuers[ca_cert["spec"]["issuerRef"]["name"]]["spec"]

    corp = render(tmp_path, DOCUMENTED["tls-cert-manager-cluster-issuer"])
    assert not find(corp, "Issuer") and len(find(corp, "Certificate")) == 1
    assert one(corp, "Certificate")["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer",
                                                            "group": "cert-manager.io"}
    with pytest.raises(HelmFailed, match="issuerRef needs a name"):
        render(tmp_path, {"webhook": {"tls": {"mode": "certManager", "certManager": {
            "issuerRef": {"kind": "ClusterIssuer"}}}}})


def test_dashboards_become_configmaps_labelled_for_grafana(tmp_path):
    docs = render(tmp_path, ALL_FEATURES)
    maps = {d["metadata"]["name"]: d for d in find(docs, "ConfigMap")}
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert len(files) >= 2 and len(maps) == len(files)
    for cm in maps.values():
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "MaruCache"}
        ((name, text),) = cm["data"].items()
        assert text.strip() == (CHART / "dashboards" / name).read_text().strip()
        assert json.loads(text)["uid"].startswith("marucache-")
    relabelled = render(tmp_path, {"dashboards": {"label": "dash", "labelValue": "yes", "namespace": "grafana"}})
    for cm in find(relabelled, "ConfigMap"):
        assert cm["metadata"]["labels"]["dash"] == "yes" and cm["metadata"]["namespace"] == "grafana"


def test_promtool_accepts_the_alert_rules(tmp_path):
    assert PROMTOOL, "promtool is not installed: run scripts/bootstrap.sh (apt-get install -y prometheus)"
    rules = alert_rules(render(tmp_path, ALL_FEATURES))
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert {"MaruCacheLoadFailuresRising", "MaruCacheIndexUnreachable", "MaruCacheIndexErrors",
            "MaruCachePoolNearlyFull", "MaruCacheSidecarNotReady"} <= names
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    run = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0 and f"SUCCESS: {len(names)} rules found" in run.stdout, run.stdout + run.stderr
    assert all(r["labels"]["team"] == "ml" for g in rules["groups"] for r in g["rules"])


def test_the_device_plugin_advertises_the_resource_caches_request_by_default(tmp_path):
    from maru_operator.models import DEFAULT_DEVICE_RESOURCE

    assert not find(render(tmp_path), "DaemonSet"), "off by default"
    docs = render(tmp_path, ALL_FEATURES)
    (plugin,) = find(docs, "DaemonSet")
    pod = plugin["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/squat/generic-device-plugin@sha256:" + "cd" * 32
    domain = next(a for a in container["args"] if a.startswith("--domain=")).split("=", 1)[1]
    devices = [json.loads(a.split("=", 1)[1]) for a in container["args"] if a.startswith("--device=")]
    # One resource per device, each handing out only its own path: what a cache on /dev/dax1.0
    # requests (the operator puts the device's name into DEFAULT_DEVICE_RESOURCE) is that device.
    for name, device in zip(("dax0.0", "dax1.0"), devices, strict=True):
        assert f"{domain}/{device['name']}" == DEFAULT_DEVICE_RESOURCE.replace("{device}", name)
        assert device["groups"] == [{"count": 16, "paths": [{"path": f"/dev/{name}"}]}]
    assert pod["nodeSelector"] == {"maru.io/cxl": "true"} and pod["imagePullSecrets"] == [{"name": "regcred"}]
    res = container["resources"]
    assert res["requests"] == res["limits"]
    with pytest.raises(HelmFailed, match="devices"):
        render(tmp_path, {"devicePlugin": {"devices": ["/dev/dax0.0"]}})  # a name, not a path


def test_the_operator_gets_the_native_sidecar_and_usage_flags(tmp_path):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    defaults = options_from_args(parser.parse_args(operator_args(render(tmp_path))))
    assert (defaults.native_sidecars, defaults.usage_seconds) == ("auto", 30)
    docs = render(tmp_path, {"operator": {"nativeSidecars": "never", "usageSeconds": 0}})
    options = options_from_args(parser.parse_args(operator_args(docs)))
    assert (options.native_sidecars, options.usage_seconds) == ("never", 0)
    with pytest.raises(HelmFailed, match="nativeSidecars"):
        render(tmp_path, {"operator": {"nativeSidecars": "sometimes"}})
