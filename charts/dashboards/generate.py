"""Generate MaruCache's Grafana dashboards (charts/marucache/dashboards/*.json).

    python charts/dashboards/generate.py          # rewrite the JSON files
    python charts/dashboards/generate.py --check  # exit 1 when they are stale

Dashboards are code (grafana-foundation-sdk, pinned in pyproject's `test`
extra); the chart globs the JSON into ConfigMaps for Grafana's sidecar, and
tests/chart runs every query against a real Prometheus scraping real
MaruCache processes. Metric names: docs/metrics.md.

Every query selects by the template variables `$namespace` and `$cache`
(connector series carry both from the sidecar, index series get `cache`
from the chart's monitors) and rates use `$__rate_interval`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Sequence

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import StackingConfig
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import (DataSourceRef, DashboardCursorSync, VariableRefresh,
                                                     VariableSort)

OUT = pathlib.Path(__file__).resolve().parents[1] / "marucache" / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'namespace=~"$namespace", cache=~"$cache"'
RATE = "$__rate_interval"


@dataclasses.dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


def rate(metric: str, by: str = "", extra: str = "") -> str:
    """`sum by (BY) (rate(METRIC{SEL, EXTRA}[$__rate_interval]))`."""
    selector = f"{SEL}, {extra}" if extra else SEL
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}[{RATE}]))"


def quantiles(histogram: str, by: str = "", selector: str = SEL) -> list[Query]:
    """p50 and p99 of a histogram (its `_bucket` series), optionally per label."""
    group = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return [Query(f"histogram_quantile({q}, sum by ({group}) (rate({histogram}_bucket{{{selector}}}[{RATE}])))",
                  f"{legend}p{int(q * 100)}") for q in (0.5, 0.99)]


def series(title: str, queries: Sequence[Query], unit: str, description: str, width: int = 12,
           stack: bool = False) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
             .height(8).span(width).fill_opacity(10 if not stack else 40).min(0))
    if stack:
        panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL))
    for ref, q in zip("ABCDEFGH", queries):
        panel = panel.with_target(prometheus.Dataquery().expr(q.expr).legend_format(q.legend or "__auto")
                                  .ref_id(ref).datasource(DATASOURCE))
    return panel


def single(title: str, expr: str, unit: str, description: str, width: int = 6) -> stat.Panel:
    return (stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
            .height(5).span(width)
            .with_target(prometheus.Dataquery().expr(expr).instant().ref_id("A").datasource(DATASOURCE)))


def variables(metric: str) -> list[dashboard.DatasourceVariable | dashboard.QueryVariable]:
    """Data source, then namespace and cache, both multi-valued with All = any."""
    def label_var(name: str, query: str) -> dashboard.QueryVariable:
        return (dashboard.QueryVariable(name).label(name).query(query).datasource(DATASOURCE)
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(".*"))
    return [dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"),
            label_var("namespace", f"label_values({metric}, namespace)"),
            label_var("cache", f'label_values({metric}{{namespace=~"$namespace"}}, cache)')]


def base(uid: str, title: str, description: str, metric: str) -> dashboard.Dashboard:
    builder = (dashboard.Dashboard(title).uid(uid).description(description).tags(["marucache"])
               .refresh("30s").time("now-1h", "now").timezone("browser")
               .tooltip(DashboardCursorSync.CROSSHAIR).editable())
    for variable in variables(metric):
        builder = builder.with_variable(variable)
    return builder


def overview() -> dashboard.Dashboard:
    """The connectors' view (exported by the sidecars): hits, loads, stores."""
    d = base("marucache-overview", "MaruCache / Overview",
             "Hits, loads (what TTFT pays), recomputation and stores of the vLLM pods of each cache.",
             "maru_lookups_total")
    d = d.with_row(dashboard.Row("Hits"))
    d = d.with_panel(single("Hit tokens per lookup", f"{rate('maru_lookup_hit_tokens_total')} / "
                            f"{rate('maru_lookups_total')}", "short",
                            "Tokens found in the cache per prefix lookup."))
    d = d.with_panel(single("Hit tokens loaded", f"1 - ({rate('maru_recomputed_tokens_total')} / "
                            f"{rate('maru_lookup_hit_tokens_total')})", "percentunit",
                            "Share of hit tokens whose KV was loaded; the rest failed to load and was recomputed."))
    d = d.with_panel(series("Hit tokens per second", [Query(rate("maru_lookup_hit_tokens_total", "pod"), "{{pod}}")],
                            "short", "Prompt tokens served from the cache instead of prefill.", width=12))
    d = d.with_panel(series("Lookups per second", [Query(rate("maru_lookups_total", "pod"), "{{pod}}")],
                            "reqps", "Prefix lookups made by each pod's scheduler.", width=12))
    d = d.with_panel(series("Parked requests", [Query(f"sum by (pod) (maru_parked_requests{{{SEL}}})", "{{pod}}")],
                            "short", "Requests waiting in vLLM for their KV to load.", width=12))
    d = d.with_panel(series("Hits parked per second", [Query(rate("maru_parked_loads_total", "pod"), "{{pod}}")],
                            "reqps", "Hits loaded while their request waited parked, beside other requests; "
                            "a lone async hit loads in its own step and is not counted.", width=12))
    d = d.with_row(dashboard.Row("Loads (time to first token)"))
    d = d.with_panel(series("Load duration", quantiles("maru_load_duration_seconds"), "s",
                            "One load, from its start to its last copy: what a hit adds to TTFT."))
    d = d.with_panel(series("Forward wait per layer", quantiles("maru_layer_wait_seconds"), "s",
                            "Time the forward pass waited for a layer's KV (overlap mode); near zero when loads "
                            "keep ahead of compute."))
    d = d.with_panel(series("Load bandwidth", [Query(rate("maru_load_bytes_total", "pod"), "{{pod}}")], "Bps",
                            "Bytes copied from the pool into vLLM's KV cache."))
    d = d.with_panel(series("Load failures by reason", [Query(rate("maru_load_failures_total", "reason"),
                                                              "{{reason}}")],
                            "reqps", "Loads that failed; vLLM recomputed their tokens.", stack=True))
    d = d.with_panel(series("Recomputed tokens per second",
                            [Query(rate("maru_recomputed_tokens_total", "pod"), "{{pod}}")], "short",
                            "Tokens recomputed because their KV could not be loaded."))
    d = d.with_row(dashboard.Row("Stores"))
    d = d.with_panel(series("Store bandwidth", [Query(rate("maru_store_bytes_total", "pod"), "{{pod}}")], "Bps",
                            "Bytes written from vLLM's KV cache into the pool and committed.", width=8))
    d = d.with_panel(series("Store duration", quantiles("maru_store_duration_seconds"), "s",
                            "One store, from reserve to commit.", width=8))
    d = d.with_panel(series("Store failures by reason", [Query(rate("maru_store_failures_total", "reason"),
                                                               "{{reason}}")],
                            "reqps", "Stores skipped or abandoned (a lost store is only a future miss).",
                            width=8, stack=True))
    d = d.with_row(dashboard.Row("Sidecars"))
    d = d.with_panel(series("Pool attached", [Query(f"sum by (pod) (maru_sidecar_pool_attached{{{SEL}}})",
                                                    "{{pod}}")],
                            "short", "1 when the pod's sidecar has the pool open and hands it to vLLM."))
    d = d.with_panel(series("Pool hand-offs by result", [Query(rate("maru_sidecar_handoffs_total", "result"),
                                                               "{{result}}")],
                            "reqps", "Pool hand-offs answered by the sidecars: ok, or the refusal."))
    d = d.with_panel(series("Stats regions dropped unattested",
                            [Query(rate("maru_sidecar_stats_regions_unattested_total", "pod"), "{{pod}}")],
                            "short", "Stats region files the sidecar removed without counting them, because no "
                            "scan saw their writer alive (a file put there, or a process shorter than a scan)."))
    return d


def index() -> dashboard.Dashboard:
    """The indexes' view (pool, keys, RPCs) and the operator's reconciles."""
    d = base("marucache-index", "MaruCache / Index and pool",
             "Pool usage, keys, evictions, leases and RPCs of each cache's index; the operator's reconciles.",
             "maru_pool_capacity_bytes")
    d = d.with_row(dashboard.Row("Pool"))
    d = d.with_panel(single("Capacity", f"sum (maru_pool_capacity_bytes{{{SEL}}})", "bytes",
                            "Bytes of the pools' data areas."))
    d = d.with_panel(single("Used", f'1 - (sum (maru_pool_bytes{{{SEL}, state="free"}}) / '
                            f"sum (maru_pool_capacity_bytes{{{SEL}}}))", "percentunit",
                            "Reserved and committed share of the pools; eviction keeps it under the high watermark."))
    d = d.with_panel(single("Keys", f"sum (maru_keys{{{SEL}}})", "short", "Committed objects."))
    d = d.with_panel(single("Leases", f"sum (maru_leases{{{SEL}}})", "short",
                            "Live client leases (connectors, sidecars' probes)."))
    d = d.with_panel(series("Pool bytes by state", [Query(f"sum by (state) (maru_pool_bytes{{{SEL}}})", "{{state}}")],
                            "bytes", "free, reserved (being written), committed (readable), pinned (being read; "
                            "part of committed)."))
    d = d.with_panel(series("Keys and evictions", [Query(f"sum by (cache) (maru_keys{{{SEL}}})", "{{cache}} keys"),
                                                   Query(rate("maru_evictions_total", "cache"),
                                                         "{{cache}} evictions/s")],
                            "short", "Committed objects, and objects evicted per second (LRU)."))
    d = d.with_panel(series("Leases", [Query(f"sum by (cache) (maru_leases{{{SEL}}})", "{{cache}}")], "short",
                            "Live client leases per cache."))
    d = d.with_row(dashboard.Row("Index RPCs"))
    d = d.with_panel(series("RPC latency p99 by op", [Query(
        f"histogram_quantile(0.99, sum by (le, op) (rate(maru_index_rpc_duration_seconds_bucket{{{SEL}}}[{RATE}])))",
        "{{op}}")], "s", "Server-side time of one request, 99th percentile, by operation.", width=8))
    d = d.with_panel(series("RPCs per second by op", [Query(rate("maru_index_rpc_duration_seconds_count", "op"),
                                                            "{{op}}")],
                            "reqps", "Requests served by the index, by operation.", width=8))
    d = d.with_panel(series("RPC errors by op and type", [Query(rate("maru_index_rpc_errors_total", "op, type"),
                                                                "{{op}} {{type}}")],
                            "reqps", "Error replies: auth (wrong token), no_lease (a lapsed lease), no_space, "
                            "quarantined (a restarted index, no slots yet), bad_request, internal.", width=8, stack=True))
    d = d.with_row(dashboard.Row("Quotas and maintenance"))
    d = d.with_panel(series("Quota refusals by quota", [Query(rate("maru_index_quota_refusals_total", "quota"),
                                                              "{{quota}}")],
                            "reqps", "Calls a lease's or a peer's quota refused or cut short (reservations, pins, "
                            "evictions per window; peer_*: all leases of one address together). An honest engine "
                            "never meets them: a steady rate names a client to look at (docs/security.md).",
                            stack=True))
    d = d.with_panel(series("Peers held to their budgets", [Query(rate("maru_index_rate_limited_total", "reason"),
                                                                  "{{reason}}")],
                            "ops", "Per-peer budgets at work: connections reset at accept (a peer connecting too "
                            "fast), wrong-token answers held back (guessing), reads paused (received_bytes: a peer "
                            "sending more than --peer-receive-rate-mib). Honest engines never meet them "
                            "(docs/security.md, The budgets).", stack=True))
    d = d.with_panel(series("Objects flushed per second", [Query(rate("maru_index_flushed_objects_total", "cache"),
                                                                 "{{cache}}")],
                            "short", "Objects removed by `marucache flush` (not the evictions that make room)."))
    d = d.with_panel(series("Block aliases", [
        Query(f"sum by (cache) (maru_index_aliases{{{SEL}}})", "{{cache}} held"),
        Query(rate("maru_index_alias_evictions_total", "cache"), "{{cache}} evicted/s")],
                            "short", "Block aliases the index holds (hits down to vLLM's block: each names "
                            "the first blocks of a stored chunk) and how fast its table's bound pushes the "
                            "oldest out. A steady eviction rate means `--max-aliases` is smaller than the "
                            "pool's chunks need: hits fall back to whole chunks."))
    d = d.with_panel(series("Garbage collection pauses", [
        Query(rate("maru_index_gc_pause_seconds_sum", "generation"), "generation {{generation}}")],
                            "s", "Seconds per second the index spent collecting garbage, by generation (2: a full "
                            "collection). Its event loop answers nobody meanwhile; start-up objects are frozen, "
                            "so a full collection walks only what serving created.", stack=True))
    d = d.with_row(dashboard.Row("Operator"))
    d = d.with_panel(single("Caches not Ready", f"sum (1 - maru_cache_ready{{{SEL}}})", "short",
                            "MaruCaches whose status is not Ready (kubectl describe mcache says why)."))
    d = d.with_panel(series("Caches by phase", [Query(f"sum by (phase) (maru_cache_phase{{{SEL}}})", "{{phase}}")],
                            "short", "MaruCaches in each status.phase: Ready, Starting, Pending, Invalid.",
                            width=18, stack=True))
    d = d.with_panel(series("Reconciles by result", [Query(
        f"sum by (result) (rate(maru_operator_reconciles_total[{RATE}]))", "{{result}}")], "reqps",
        "MaruCache reconciles: ready, progressing, waiting, invalid, error, released.", stack=True))
    d = d.with_panel(series("Reconcile duration", quantiles("maru_operator_reconcile_duration_seconds",
                                                            selector=""), "s",
                            "Time one reconcile took."))
    return d


DASHBOARDS = {"marucache-overview.json": overview, "marucache-index.json": index}


def render(build: dashboard.Dashboard) -> str:
    """Stable JSON: panel ids in order, keys sorted, two-space indent, one trailing newline."""
    model = build.build()
    panel_id = 0
    for panel in model.panels or []:
        for item in [panel, *(getattr(panel, "panels", None) or [])]:
            panel_id += 1
            item.id_val = panel_id
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def rendered() -> dict[str, str]:
    return {name: render(make()) for name, make in DASHBOARDS.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a file is stale")
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="directory of the JSON files")
    args = parser.parse_args(argv)
    stale = []
    for name, text in rendered().items():
        path = args.out / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run python charts/dashboards/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
