"""The chart's alerts under `promtool test rules`: every alert fires on its condition only after its
rendered `for:` (not a minute earlier) and stays quiet on a healthy cluster; every alert links its own
runbook section; the monitors never let a scraped pod choose its `namespace`, `pod` or `cache`."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_tools import ALL_FEATURES, ALL_FEATURES_SM, ROOT, alert_rules, find, render

PROMTOOL = shutil.which("promtool")
RUNBOOKS = ROOT / "docs" / "runbooks.md"
SIDECAR = {"namespace": "team-a", "cache": "c1", "pod": "vllm-0"}
CACHE = {"namespace": "team-a", "cache": "c1"}
WEBHOOK = "inject.marucache.maru.io"
DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
MINUTES = {"ms": 1 / 60000, "s": 1 / 60, "m": 1, "h": 60, "d": 1440, "w": 10080, "y": 525600}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    """One promtool input series; `values` uses promtool's notation with N for the run's length."""
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


@dataclasses.dataclass(frozen=True)
class Case:
    """Series under which `alert` must fire, and the labels it fires with (besides severity)."""

    alert: str
    inputs: tuple[tuple[str, dict[str, str], str], ...]
    labels: dict[str, str]


RISING, FLAT = "0+60xN", "0xN"  # a counter growing 1/s; one that never moves
FIRING_CASES = [
    Case("MaruCacheLoadFailuresRising",
         (("maru_load_failures_total", {**SIDECAR, "reason": "timeout"}, RISING),), SIDECAR),
    Case("MaruCacheIndexUnreachable",
         (("maru_load_failures_total", {**SIDECAR, "reason": "index_error"}, RISING),
          ("maru_store_failures_total", {**SIDECAR, "reason": "index_error"}, FLAT)), SIDECAR),
    Case("MaruCacheIndexErrors",
         (("maru_index_rpc_errors_total", {**CACHE, "op": "lookup", "type": "internal"}, RISING),),
         {**CACHE, "op": "lookup", "type": "internal"}),
    Case("MaruCachePoolNearlyFull",
         (("maru_pool_bytes", {**CACHE, "state": "free"}, "1xN"), ("maru_pool_capacity_bytes", CACHE, "100xN")),
         CACHE),
    Case("MaruCacheSidecarNotReady", (("maru_sidecar_pool_attached", SIDECAR, "0xN"),), SIDECAR),
    Case("MaruCacheReconcileErrors",
         (("maru_operator_reconciles_total", {"namespace": "maru-system", "result": "error"}, RISING),),
         {"namespace": "maru-system"}),
    Case("MaruCacheNotReady", (("maru_cache_ready", CACHE, "0xN"),), CACHE),
    Case("MaruCacheIndexAbsent",  # Ready by the operator, but no index series
         (("maru_cache_phase", {**CACHE, "phase": "Ready"}, "1xN"), ("maru_cache_ready", CACHE, "1xN")), CACHE),
    Case("MaruCacheIndexAbsent",  # a Starting cache whose index never comes up
         (("maru_cache_phase", {**CACHE, "phase": "Starting"}, "1xN"), ("maru_cache_ready", CACHE, "0xN")), CACHE),
    Case("MaruCacheStalePods",
         (("maru_operator_stale_pods", {**CACHE, "reason": "old_placement"}, "2xN"),), CACHE),
    Case("MaruCachePodsNotInjected",
         (("maru_operator_stale_pods", {**CACHE, "reason": "not_injected"}, "1xN"),), CACHE),
    Case("MaruCacheWebhookFailing",  # failurePolicy Ignore: the API server fails open
         (("apiserver_admission_webhook_fail_open_count", {"name": WEBHOOK, "type": "admit"}, "0+1xN"),),
         {"name": WEBHOOK}),
    Case("MaruCacheWebhookFailing",  # failurePolicy Fail: the call's errors reject pods
         (("apiserver_admission_webhook_rejection_count",
           {"name": WEBHOOK, "type": "admit", "operation": "CREATE", "error_type": "calling_webhook_error",
            "rejection_code": "500"}, "0+1xN"),), {"name": WEBHOOK}),
    Case("MaruCacheOperatorAbsent", (("maru_cache_ready", CACHE, "1xN"),), {}),
]

# A healthy cluster: every series each alert reads is there, and none says anything is wrong.
HEALTHY = (
    ("maru_load_failures_total", {**SIDECAR, "reason": "timeout"}, FLAT),
    ("maru_store_failures_total", {**SIDECAR, "reason": "index_error"}, FLAT),
    ("maru_load_failures_total", {**SIDECAR, "reason": "index_error"}, FLAT),
    ("maru_index_rpc_errors_total", {**CACHE, "op": "lookup", "type": "internal"}, FLAT),
    ("maru_index_rpc_errors_total", {**CACHE, "op": "lookup", "type": "not_found"}, RISING),
    ("maru_pool_bytes", {**CACHE, "state": "free"}, "50xN"),
    ("maru_pool_capacity_bytes", CACHE, "100xN"),
    ("maru_sidecar_pool_attached", SIDECAR, "1xN"),
    ("maru_operator_reconciles_total", {"namespace": "maru-system", "result": "error"}, FLAT),
    ("maru_operator_reconciles_total", {"namespace": "maru-system", "result": "ready"}, RISING),
    ("maru_cache_ready", CACHE, "1xN"),
    ("maru_cache_phase", {**CACHE, "phase": "Ready"}, "1xN"),
    ("maru_cache_phase", {**CACHE, "phase": "Starting"}, "0xN"),
    ("maru_operator_stale_pods", {**CACHE, "reason": "old_placement"}, "0xN"),
    ("maru_operator_stale_pods", {**CACHE, "reason": "not_injected"}, "0xN"),
    ("apiserver_admission_webhook_fail_open_count", {"name": WEBHOOK, "type": "admit"}, FLAT),
    ("apiserver_admission_webhook_rejection_count",  # the webhook's own refusals are no failure
     {"name": WEBHOOK, "type": "admit", "operation": "CREATE", "error_type": "no_error", "rejection_code": "403"},
     RISING),
)


def minutes(duration: str) -> float:
    parts = DURATION.findall(duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a Prometheus duration: {duration}"
    return sum(int(n) * MINUTES[u] for n, u in parts)


def test_minutes_reads_prometheus_durations():
    assert (minutes("90s"), minutes("1h30m"), minutes("15m")) == (1.5, 90, 15)


def promtool_inputs(inputs: tuple[tuple[str, dict[str, str], str], ...], length: int) -> list[dict[str, str]]:
    return [series(name, labels, values.replace("N", str(length))) for name, labels, values in inputs]


def unit_tests(rules: dict[str, Any], rules_file: str) -> dict[str, Any]:
    """promtool's test file: per firing case, no alert a minute before `for` has passed and the alert
    (labels, runbook) two minutes after; on the healthy series, no alert at all."""
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    tests = []
    for case in FIRING_CASES:
        rule = by_name[case.alert]
        hold = minutes(rule["for"])
        length = int(hold) + 15
        expected = {"exp_labels": {**rule["labels"], **case.labels},
                    "exp_annotations": {"runbook_url": rule["annotations"]["runbook_url"]}}
        tests.append({"interval": "1m", "input_series": promtool_inputs(case.inputs, length),
                      "alert_rule_test": [
                          {"eval_time": f"{int(hold * 60) - 60}s", "alertname": case.alert, "exp_alerts": []},
                          {"eval_time": f"{int(hold * 60) + 120}s", "alertname": case.alert,
                           "exp_alerts": [expected]}]})
    longest = int(max(minutes(r["for"]) for r in by_name.values())) + 15
    tests.append({"interval": "1m", "input_series": promtool_inputs(HEALTHY, longest),
                  "alert_rule_test": [{"eval_time": f"{longest - 5}m", "alertname": name, "exp_alerts": []}
                                      for name in by_name]})
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


def rules_for_promtool(spec: dict[str, Any]) -> dict[str, Any]:
    """The rendered groups with only the runbook among the annotations (promtool compares annotations
    exactly, and the others are templates of the firing value)."""
    groups = []
    for group in spec["groups"]:
        rules = [{**r, "annotations": {"runbook_url": r["annotations"]["runbook_url"]}} for r in group["rules"]]
        groups.append({**group, "rules": rules})
    return {"groups": groups}


@pytest.mark.parametrize("values", [ALL_FEATURES, ALL_FEATURES_SM], ids=["podmonitor", "servicemonitor"])
def test_every_alert_fires_after_its_for_and_never_before(tmp_path, values):
    assert PROMTOOL, "promtool is not installed: run scripts/bootstrap.sh (apt-get install -y prometheus)"
    spec = alert_rules(render(tmp_path, values))
    names = {r["alert"] for g in spec["groups"] for r in g["rules"]}
    assert names == {c.alert for c in FIRING_CASES}, f"alerts without a firing case: {names ^ {c.alert for c in FIRING_CASES}}"
    for rule in (r for g in spec["groups"] for r in g["rules"]):
        assert minutes(rule["for"]) >= 1, f"{rule['alert']}: for {rule['for']}"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules_for_promtool(spec)))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(unit_tests(spec, "rules.yaml")))
    run = subprocess.run([PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def test_a_shorter_for_is_caught(tmp_path):
    """The unit tests see an alert that fires early: the same run with one `for` halved fails."""
    assert PROMTOOL
    spec = alert_rules(render(tmp_path, {"monitoring": {"prometheusRule": {"enabled": True}}}))
    tests = unit_tests(spec, "rules.yaml")
    early = rules_for_promtool(spec)
    rule = next(r for g in early["groups"] for r in g["rules"] if r["alert"] == "MaruCacheNotReady")
    rule["for"] = f"{int(minutes(rule['for']) // 2)}m"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(early))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    run = subprocess.run([PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "MaruCacheNotReady" in run.stdout + run.stderr, run.stdout + run.stderr


def test_the_webhook_alerts_follow_the_webhook(tmp_path):
    spec = alert_rules(render(tmp_path, {"monitoring": {"prometheusRule": {"enabled": True}},
                                         "webhook": {"enabled": False}}))
    names = {r["alert"] for g in spec["groups"] for r in g["rules"]}
    assert "MaruCacheWebhookFailing" not in names and "MaruCachePodsNotInjected" not in names
    hook = find(render(tmp_path), "MutatingWebhookConfiguration")[0]["webhooks"][0]
    enabled = alert_rules(render(tmp_path, {"monitoring": {"prometheusRule": {"enabled": True}}}))
    failing = next(r for g in enabled["groups"] for r in g["rules"] if r["alert"] == "MaruCacheWebhookFailing")
    assert f'name="{hook["name"]}"' in failing["expr"] and hook["name"] == WEBHOOK


def github_anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    """Anchor -> text of each `## ` section of docs/runbooks.md."""
    parts = re.split(r"^## (.+)$", RUNBOOKS.read_text(), flags=re.M)
    return {github_anchor(title): body for title, body in zip(parts[1::2], parts[2::2])}


def test_every_alert_links_a_runbook_section_that_says_what_how_to_check_and_fix(tmp_path):
    base = "https://example.com/docs/runbooks.md"
    spec = alert_rules(render(tmp_path, {"monitoring": {"prometheusRule": {"enabled": True, "runbookUrl": base}}}))
    sections = runbook_sections()
    for rule in (r for g in spec["groups"] for r in g["rules"]):
        url = rule["annotations"]["runbook_url"]
        prefix, _, anchor = url.partition("#")
        assert prefix == base and anchor == rule["alert"].lower(), url
        assert anchor in sections, f"{rule['alert']}: no section {anchor} in docs/runbooks.md"
        for part in ("**Meaning.**", "**Check.**", "**Fix.**"):
            assert part in sections[anchor], f"{rule['alert']}: its runbook lacks {part}"
    assert len(sections) == len({r["alert"] for g in spec["groups"] for r in g["rules"]}), sorted(sections)


def endpoints(monitor: dict[str, Any]) -> list[dict[str, Any]]:
    return monitor["spec"].get("podMetricsEndpoints") or monitor["spec"]["endpoints"]


@pytest.mark.parametrize("values, kind", [(ALL_FEATURES, "PodMonitor"), (ALL_FEATURES_SM, "ServiceMonitor")],
                         ids=["podmonitor", "servicemonitor"])
def test_no_scraped_pod_sets_its_own_namespace_or_cache(tmp_path, values, kind):
    monitors = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in find(render(tmp_path, values), kind)}
    assert set(monitors) == {"operator", "index", "sidecar"}
    for component in ("index", "sidecar"):
        (endpoint,) = endpoints(monitors[component])
        assert endpoint["honorLabels"] is False, component
        (relabel,) = [r for r in endpoint["relabelings"] if r["targetLabel"] == "cache"]
        assert relabel["sourceLabels"][0].startswith("__meta_kubernetes_"), relabel
    (sidecar,) = endpoints(monitors["sidecar"])
    assert sidecar["relabelings"][0]["sourceLabels"] == ["__meta_kubernetes_pod_label_maru_io_cache"]
    # The operator alone reports on caches of other namespaces; it is the chart's own Deployment.
    (operator,) = endpoints(monitors["operator"])
    assert operator["honorLabels"] is True


def test_the_rules_test_needs_promtool_from_bootstrap():
    script = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert "command -v promtool" in script and "install -y -qq prometheus" in script
    assert Path(PROMTOOL or "").name == "promtool", "promtool is not installed: run scripts/bootstrap.sh"
