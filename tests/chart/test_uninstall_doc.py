"""docs/helm.md, "Upgrade" and "Uninstall": every object the page says
`helm uninstall` leaves, and every name its commands use, is the one the real
chart renders and the operator uses."""

from __future__ import annotations

import re
import shlex

from helm_tools import CHART, ROOT, find, one, operator_args, render

from maru_operator import FINALIZER

DOC = ROOT / "docs" / "helm.md"


def section(title: str) -> str:
    return DOC.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def commands(text: str) -> list[list[str]]:
    return [shlex.split(line) for block in re.findall(r"```sh\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.strip()]


def flag_value(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(name + "="))


def test_what_uninstall_leaves_is_named_as_the_chart_and_operator_name_it(tmp_path):
    docs = render(tmp_path, release="marucache", namespace="maru-system")
    crd = one(docs, "CustomResourceDefinition")
    args = operator_args(docs)
    text = section("Uninstall")
    # Left on purpose: the CRD is kept, and it carries what Helm needs to hand it to another release.
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert f"`{FINALIZER}`" in text
    by_verb = {(c[1], c[2]): c for c in commands(text) if c[0] == "kubectl" and len(c) > 3}
    assert by_verb[("delete", "crd")][3] == crd["metadata"]["name"]
    assert by_verb[("annotate", "crd")][3] == crd["metadata"]["name"]
    ledger = by_verb[("delete", "configmap")]
    assert ledger[3] == flag_value(args, "--ledger-name") and ledger[-1] == flag_value(args, "--namespace")
    lease = by_verb[("delete", "lease")]
    assert lease[3] == flag_value(args, "--lease-name") and lease[-1] == flag_value(args, "--namespace")
    assert by_verb[("delete", "mcache")][2] == "mcache" and "--all" in by_verb[("delete", "mcache")]
    # The stuck-finalizer patch clears exactly metadata.finalizers (a JSON merge patch with null).
    patch = by_verb[("patch", "mcache")]
    assert patch[patch.index("--type=merge") + 2] == '{"metadata":{"finalizers":null}}'
    # Nothing else of the chart has a resource policy: everything else goes with the release.
    kept = [d["metadata"]["name"] for d in docs if (d["metadata"].get("annotations") or {}).get("helm.sh/resource-policy")]
    assert kept == [crd["metadata"]["name"]]
    assert find(docs, "MutatingWebhookConfiguration"), "the webhook configuration is the chart's: uninstall removes it"


def test_the_crd_is_a_template_so_helm_upgrade_upgrades_it(tmp_path):
    assert not (CHART / "crds").exists(), "Helm never upgrades what a chart's crds/ directory holds"
    text = section("Upgrade")
    assert "helm upgrade marucache charts/marucache" in text
    docs = render(tmp_path, release="marucache", namespace="maru-system")
    versions = one(docs, "CustomResourceDefinition")["spec"]["versions"]
    assert [(v["name"], v["served"], v["storage"]) for v in versions] == [("v1alpha1", True, True)]
    assert "`maru.io/v1alpha1` is the only version now" in text
