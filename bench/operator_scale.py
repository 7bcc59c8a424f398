"""How long N MaruCaches created at once take to become Ready (the real operator, kmock as the API).

    .venv/bin/python bench/operator_scale.py [--caches 100] [--json]

kmock has no controllers, so a small stand-in plays the Deployment
controller: as soon as an index Deployment appears, it reports one available
replica (what a real cluster would do once the index pod is up). The time
measured is therefore the operator's own work: allocation through the
ledger, five children per cache, status, events — not image pulls.

Besides the time, it reports what the operator asked of the API server:
requests, ledger writes, and writes refused for a stale resourceVersion.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import sys
import tempfile
import threading
import time

import requests

from maru_operator.cli import OperatorOptions
from maru_tools.kube_emulator import KmockCluster, OperatorThread, iter_objects

CACHES = "/apis/maru.io/v1alpha1/namespaces/bench/marucaches"


def _deployment_controller(cluster: KmockCluster, stop: threading.Event) -> None:
    http = requests.Session()
    done: set[tuple[str | None, str]] = set()
    while not stop.is_set():
        for ns, name, _ in iter_objects(cluster, "apps/v1/deployments"):
            if (ns, name) not in done:
                http.patch(f"{cluster.url}/apis/apps/v1/namespaces/{ns}/deployments/{name}/status",
                           json={"status": {"availableReplicas": 1, "readyReplicas": 1, "replicas": 1}},
                           headers={"Content-Type": "application/merge-patch+json"}, timeout=30)
                done.add((ns, name))
        stop.wait(0.5)


def _ready_count(cluster: KmockCluster) -> int:
    return sum(1 for _, _, body in iter_objects(cluster, "maru.io/v1alpha1/marucaches")
               if (body.get("status") or {}).get("phase") == "Ready")


def run(caches: int, args_resync: float = OperatorOptions().resync_seconds) -> dict:
    with KmockCluster() as cluster, tempfile.TemporaryDirectory() as tmp:
        http = requests.Session()
        for i in range(4):  # four DAX hosts sharing one 4 TiB device behind a CXL switch
            http.post(f"{cluster.url}/api/v1/nodes", timeout=30, json={
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": f"cxl-{i}", "labels": {"maru.io/cxl": "true"},
                             "annotations": {"maru.io/dax-devices": json.dumps(
                                 [{"path": "/dev/dax0.0", "size": "4Ti", "uuid": "cxl-switch-0"}])}}})
        options = OperatorOptions(kubeconfig=str(cluster.write_kubeconfig(pathlib.Path(tmp) / "kubeconfig")),
                                  resync_seconds=args_resync, metrics_port=None, webhook=False)
        stop = threading.Event()
        controller = threading.Thread(target=_deployment_controller, args=(cluster, stop), daemon=True)
        with OperatorThread(options) as operator:
            controller.start()
            bodies = [{"apiVersion": "maru.io/v1alpha1", "kind": "MaruCache",
                       "metadata": {"name": f"cache-{i:03d}", "namespace": "bench"},
                       "spec": {"pool": {"deviceClass": "dax", "size": "16Gi"}}} for i in range(caches)]
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda b: requests.post(cluster.url + CACHES, json=b, timeout=30).raise_for_status(),
                              bodies))
            created = time.perf_counter() - start
            while _ready_count(cluster) < caches:
                if time.perf_counter() - start > 300:
                    raise SystemExit(f"only {_ready_count(cluster)} of {caches} Ready after 300 s")
                time.sleep(0.5)
            elapsed = time.perf_counter() - start
            stop.set()
            controller.join(timeout=10)
            claims = json.loads(next(b for _, n, b in iter_objects(cluster, "v1/configmaps")
                                     if n == "marucache-ledger")["data"]["ledger.json"])["claims"]
            spans = sorted((c["offset"], c["offset"] + c["size"]) for c in claims)
            disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
            reconciles = sum(operator.metrics.registry.get_sample_value(
                "maru_operator_reconciles_total", {"result": r}) or 0 for r in ("ready", "progressing"))
            traffic = cluster.call(lambda: _traffic(cluster))
        return {"case": "operator_scale", "caches": caches, "resync_s": args_resync, "created_s": round(created, 2),
                "all_ready_s": round(elapsed, 2), "target_s": 10.0, "claims": len(claims),
                "disjoint": disjoint, "reconciles": int(reconciles), **traffic}


def _traffic(cluster: KmockCluster) -> dict[str, int]:
    """What the operator asked of the API server (the benchmark's own requests use `requests`)."""
    assert cluster.emulator is not None
    mine = [r for r in cluster.emulator if not r.headers.get("User-Agent", "").startswith("python-requests")]
    ledger = [r for r in mine if r.method.value in ("POST", "PATCH")
              and r.url.path.startswith("/api/v1/namespaces/maru-system/configmaps")]
    return {"operator_requests": len(mine), "ledger_writes": len(ledger), "conflicts": cluster.emulator.conflicts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", type=int, default=100)
    parser.add_argument("--resync-seconds", type=float, default=OperatorOptions().resync_seconds,
                        help="the operator's --resync-seconds (default: the operator's own default, %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args.caches, args.resync_seconds)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['caches']} MaruCaches Ready in {result['all_ready_s']} s "
              f"(target {result['target_s']} s); {result['claims']} claims, disjoint={result['disjoint']}, "
              f"{result['reconciles']} reconciles, {result['operator_requests']} API requests "
              f"({result['ledger_writes']} ledger writes, {result['conflicts']} conflicts)")
    return 0 if result["disjoint"] and result["claims"] == args.caches else 1


if __name__ == "__main__":
    sys.exit(main())
