"""Every dashboard query, variable query and alert expression against a real Prometheus that scrapes
a real index (`marucache index`), a real sidecar fed by a stats writer, and the real operator."""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import urllib.request
from pathlib import Path

import pytest
from chart_operator import CACHES, OperatorRun, wait_for
from helm_tools import CHART, alert_rules, render
from prometheus_client.parser import text_string_to_metric_families
from sidecar_helpers import PROMETHEUS, PrometheusServer, SidecarProcess, connector_traffic

from maru_tools.index_process import IndexProcess, free_port
from maru_core.index.client import IndexClient, IndexRejected

# What Grafana substitutes, as a user who picked one namespace and one cache would see it.
VARIABLES = {"$namespace": "team-a", "$cache": "c1", "$__rate_interval": "10s"}
METRIC = re.compile(r"\bmaru_[a-z0-9_]+")
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def panels(dashboard: dict) -> list[dict]:
    return [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])] if p.get("targets")]


DASHBOARDS = {p.name: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}
PANEL_QUERIES = [(f"{name}: {panel['title']} [{target['refId']}]", target["expr"])
                 for name, board in DASHBOARDS.items() for panel in panels(board) for target in panel["targets"]]
VARIABLE_QUERIES = [(f"{name}: ${v['name']}", v["query"]) for name, board in DASHBOARDS.items()
                    for v in board["templating"]["list"] if v["type"] == "query"]


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown template variable in {expr}"
    return expr


class Scraped:
    """The live Prometheus and the metric names the scraped processes export."""

    def __init__(self, prom: PrometheusServer, exported: set[str]):
        self.prom = prom
        self.exported = exported


def exported_names(*ports: int) -> set[str]:
    """Every sample name (with _bucket, _count, _sum, _total) on the processes' /metrics."""
    names: set[str] = set()
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        names |= {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    return names


def refuse_a_stale_token(url: str) -> None:
    stale = IndexClient(url, token="stale", timeout_s=2.0, heartbeat=False)
    try:
        with pytest.raises(IndexRejected):
            stale.heartbeat()
    finally:
        stale.close()


@pytest.fixture(scope="module")
def scraped(operator_run: OperatorRun, sock_dir, tmp_path_factory):
    assert PROMETHEUS, "prometheus is not installed: run scripts/bootstrap.sh (apt-get install -y prometheus)"
    # The cache the index below serves, made Ready (the test plays the Deployment controller): its
    # operator series must join the index's and the sidecar's on (namespace, cache).
    operator_run.kube("POST", CACHES.format(ns="team-a"), {
        "apiVersion": "maru.io/v1alpha1", "kind": "MaruCache", "metadata": {"name": "c1", "namespace": "team-a"},
        "spec": {"pool": {"deviceClass": "shm", "size": "1Gi"}}})
    index_status = "/apis/apps/v1/namespaces/team-a/deployments/c1-maru-index/status"
    wait_for(lambda: operator_run.kube("GET", index_status.rsplit("/", 1)[0]), what="index Deployment of c1")
    operator_run.kube("PATCH", index_status, {"status": {"availableReplicas": 1, "readyReplicas": 1, "replicas": 1}},
                      "application/merge-patch+json")
    metrics_port = free_port()
    index = IndexProcess(pool_size="16Mi", extra_args=("--metrics-port", str(metrics_port),
                                                       "--metrics-addr", "127.0.0.1"))
    workdir = tmp_path_factory.mktemp("prometheus")
    with index:
        sidecar = SidecarProcess(index.pool_path, sock_dir / "maru.sock", index.url, token_file=index.token_file,
                                 env={"POD_NAMESPACE": "team-a", "POD_NAME": "vllm-0"})
        sidecar.start()
        prom = PrometheusServer(workdir, {})
        # The chart's monitors: sidecar and index targets get `namespace`, `pod` and `cache` from the
        # scraped object (honorLabels false: the sidecar's own labels become exported_*); the operator's
        # labels are kept (honorLabels true: its per-cache series name the cache's namespace).
        (workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 500ms, scrape_timeout: 400ms, evaluation_interval: 1s}\nscrape_configs:\n"
            f"  - {{job_name: sidecar, honor_labels: false, static_configs: [{{targets: ['127.0.0.1:{sidecar.port}'], "
            "labels: {cache: c1, namespace: team-a, pod: vllm-0}}]}\n"
            f"  - {{job_name: index, honor_labels: false, static_configs: [{{targets: ['127.0.0.1:{metrics_port}'], "
            "labels: {cache: c1, namespace: team-a}}]}\n"
            f"  - {{job_name: operator, honor_labels: true, static_configs: [{{targets: "
            f"['127.0.0.1:{operator_run.metrics_port}'], labels: {{namespace: maru-system}}}}]}}\n")
        stop, errors = threading.Event(), []
        traffic = threading.Thread(target=connector_traffic, args=(index, sock_dir, stop, errors), daemon=True)
        try:
            prom.start()
            traffic.start()
            prom.wait_for('maru_load_failures_total{reason="timeout", cache="c1"} > 0 and on() '
                          '(maru_keys{cache="c1"} > 0) and on() (maru_cache_ready{namespace="team-a", cache="c1"} == 1)',
                          errors=errors)
            # The auth error counter is born at 1 with the traffic's first refusal: a second one
            # after it has been scraped gives rate() an increase to see.
            refuse_a_stale_token(index.url)
            prom.wait_for('increase(maru_index_rpc_errors_total{type="auth"}[1m]) > 0', errors=errors)
            # Enough samples for rate() over the dashboards' 10 s windows.
            wait_for(lambda: prom.query('count_over_time(maru_lookups_total{cache="c1"}[10s]) >= 8'), what="samples")
            assert not errors, errors
            yield Scraped(prom, exported_names(sidecar.port, metrics_port, operator_run.metrics_port))
        finally:
            stop.set()
            traffic.join(timeout=30)
            prom.stop()
            sidecar.close()


@pytest.fixture(scope="module")
def sock_dir():
    """A short directory for the sidecar's socket (sockaddr_un limits its path)."""
    directory = Path(tempfile.mkdtemp(prefix="maru-ch-", dir="/tmp"))
    yield directory
    for child in directory.iterdir():
        child.unlink()
    os.rmdir(directory)


def test_the_dashboards_have_the_promised_panels():
    titles = {p["title"] for board in DASHBOARDS.values() for p in panels(board)}
    assert {"Hit tokens per lookup", "Load duration", "Forward wait per layer", "Load failures by reason",
            "Recomputed tokens per second", "Parked requests", "Store bandwidth", "Store failures by reason",
            "Pool bytes by state", "Keys and evictions", "Leases", "RPC latency p99 by op",
            "RPC errors by op and type", "Reconciles by result", "Quota refusals by quota", "Caches by phase",
            "Caches not Ready", "Objects flushed per second", "Stats regions dropped unattested",
            "Peers held to their budgets", "Garbage collection pauses"} <= titles
    assert len(PANEL_QUERIES) >= 25


@pytest.mark.parametrize("where, expr", PANEL_QUERIES, ids=[w for w, _ in PANEL_QUERIES])
def test_every_panel_query_returns_data(scraped: Scraped, where, expr):
    names = set(METRIC.findall(expr))
    assert names and names <= scraped.exported, f"{where}: not exported: {sorted(names - scraped.exported)}"
    result = scraped.prom.query(substitute(expr))
    assert result, f"{where}: no data for {substitute(expr)}"


@pytest.mark.parametrize("where, query", VARIABLE_QUERIES, ids=[w for w, _ in VARIABLE_QUERIES])
def test_every_variable_query_finds_its_label(scraped: Scraped, where, query):
    match = LABEL_VALUES.match(query)
    assert match, f"{where}: {query}"
    assert set(METRIC.findall(query)) <= scraped.exported
    label = match["label"]
    values = {s["metric"].get(label) for s in scraped.prom.query(
        f"count by ({label}) ({substitute(match['selector'])})")}
    assert values == {VARIABLES[f"${label}"]}, f"{where}: {values}"


@pytest.fixture(scope="module")
def rules(tmp_path_factory) -> dict[str, str]:
    # rate() over 5m of a series a few seconds old is a fraction of the real rate: a low threshold.
    values = {"monitoring": {"prometheusRule": {"enabled": True, "loadFailuresPerSecond": 0.01}}}
    spec = alert_rules(render(tmp_path_factory.mktemp("rules"), values))
    return {rule["alert"]: rule["expr"] for group in spec["groups"] for rule in group["rules"]}


# Under the traffic (timeouts on every load, a stale token refused by the index) these fire;
# a healthy pool, an attached sidecar, a Ready cache whose index is scraped and a running operator
# keep the others quiet. The webhook's series come from the API server, which is not here.
FIRING = {"MaruCacheLoadFailuresRising", "MaruCacheIndexUnreachable", "MaruCacheIndexErrors"}
QUIET = {"MaruCachePoolNearlyFull", "MaruCacheSidecarNotReady", "MaruCacheReconcileErrors", "MaruCacheNotReady",
         "MaruCacheIndexAbsent", "MaruCacheStalePods", "MaruCachePodsNotInjected", "MaruCacheOperatorAbsent"}
FROM_THE_API_SERVER = {"MaruCacheWebhookFailing"}


def watched_series(expr: str) -> str:
    """The part of an alert's expression that must return series for its verdict to mean anything:
    what is compared with the threshold, what `unless` subtracts from, what `absent` looks for."""
    expr = expr.strip()
    if expr.startswith("absent("):
        return expr[len("absent("):-1]
    if " unless " in expr:
        return expr.split(" unless ")[0]
    left = re.split(r"\s(?:>|==)\s[^()]*$", expr)[0]
    assert left != expr, f"no threshold found in {expr}"
    return left


def test_every_alert_expression_is_evaluated_on_real_series(scraped: Scraped, rules):
    assert set(rules) == FIRING | QUIET | FROM_THE_API_SERVER
    for alert, expr in rules.items():
        names = set(METRIC.findall(expr))
        assert names <= scraped.exported, f"{alert}: not exported: {sorted(names - scraped.exported)}"
        fired = scraped.prom.query(expr)
        if alert in FROM_THE_API_SERVER:
            assert not names and not fired, f"{alert}: {expr} -> {fired}"
            continue
        assert names, alert
        assert scraped.prom.query(watched_series(expr)), f"{alert}: no series for {watched_series(expr)}"
        assert bool(fired) == (alert in FIRING), f"{alert}: {expr} -> {fired}"
        for series in fired:
            assert series["metric"].get("cache") == "c1" and series["metric"].get("namespace") == "team-a", series


def test_the_operator_series_of_a_cache_carry_its_namespace(scraped: Scraped):
    (ready,) = scraped.prom.query('maru_cache_ready{cache="c1"}')
    assert ready["metric"]["namespace"] == "team-a" and ready["value"][1] == "1", ready
    phases = {s["metric"]["phase"]: s["value"][1] for s in scraped.prom.query('maru_cache_phase{cache="c1"}')}
    assert phases == {"Ready": "1", "Starting": "0", "Pending": "0", "Invalid": "0"}, phases
