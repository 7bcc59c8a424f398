"""`marucache operator`: the composition root of the operator process.

Builds the API client, the ledger store, the metrics registry and the kopf
registry and settings once, and runs kopf cluster-wide. The same
`OperatorOptions` → `build_operator` path is used by the tests and the
benchmark, which run it in a thread against kmock.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import pathlib
import threading
from typing import Any

import kopf

from . import FINALIZER
from .handlers import OperatorContext, build_registry, report_refusal
from .k8s import KubeApi, LedgerStore, load_configuration
from .metrics import OperatorMetrics
from .usage import DEFAULT_URL_TEMPLATE, http_reader, url_template
from .webhook import SelfSigningWebhookServer, register_webhook


@dataclasses.dataclass
class OperatorOptions:
    kubeconfig: str | None = None
    context: str | None = None
    namespace: str = "maru-system"  # where the ledger ConfigMap lives
    ledger_name: str = "marucache-ledger"
    resync_seconds: float = 5.0
    metrics_port: int | None = 8080
    metrics_addr: str = "0.0.0.0"
    webhook: bool = True
    webhook_addr: str = "0.0.0.0"
    webhook_port: int = 9443
    webhook_host: str | None = None
    webhook_cert_dir: str | None = None
    webhook_insecure: bool = False
    webhook_manage: bool = False
    liveness: str | None = None
    native_sidecars: str = "auto"
    usage_seconds: float = 30.0
    index_metrics_url: str = DEFAULT_URL_TEMPLATE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = OperatorOptions()
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account, "
                                             "else $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context to use")
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", d.namespace),
                        help="namespace of the region ledger ConfigMap (default: $POD_NAMESPACE or %(default)s)")
    parser.add_argument("--ledger-name", default=d.ledger_name, help="name of the ledger ConfigMap")
    parser.add_argument("--resync-seconds", type=float, default=d.resync_seconds,
                        help="how often a cache that is not Ready is reconciled again")
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port (0: off)")
    parser.add_argument("--metrics-addr", default=d.metrics_addr)
    parser.add_argument("--no-webhook", dest="webhook", action="store_false", help="do not serve the webhook")
    parser.add_argument("--webhook-addr", default=d.webhook_addr)
    parser.add_argument("--webhook-port", type=int, default=d.webhook_port)
    parser.add_argument("--webhook-host", help="host name the API server uses to reach the webhook "
                                               "(certificate name; default: the listen address)")
    parser.add_argument("--webhook-cert-dir", help="directory with tls.crt and tls.key (e.g. a mounted Secret); "
                                                   "default: a self-signed certificate made at start")
    parser.add_argument("--webhook-insecure", action="store_true", help="plain HTTP (local testing only)")
    parser.add_argument("--webhook-manage", action="store_true",
                        help="let the operator create and update the MutatingWebhookConfiguration")
    parser.add_argument("--liveness", help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--native-sidecars", choices=("auto", "always", "never"), default=d.native_sidecars,
                        help="inject the sidecar as a native sidecar (init container with restartPolicy Always): "
                             "auto = when the API server is Kubernetes 1.29 or newer (default)")
    parser.add_argument("--usage-seconds", type=float, default=d.usage_seconds,
                        help="how often status.used is read from each index's /metrics (0: never)")
    parser.add_argument("--index-metrics-url", default=d.index_metrics_url,
                        help="where an index's /metrics is, with {index} (its Service), {namespace} and {port} "
                             "(spec.index.metricsPort); default: the Service's cluster DNS name")


def options_from_args(args: argparse.Namespace) -> OperatorOptions:
    fields = {f.name for f in dataclasses.fields(OperatorOptions)}
    return OperatorOptions(**{k: v for k, v in vars(args).items() if k in fields})


def webhook_server(options: OperatorOptions) -> kopf.WebhookServer:
    if options.webhook_insecure:
        return kopf.WebhookServer(addr=options.webhook_addr, port=options.webhook_port,
                                  host=options.webhook_host, insecure=True)
    if options.webhook_cert_dir:
        cert_dir = pathlib.Path(options.webhook_cert_dir)
        for name in ("tls.crt", "tls.key"):
            if not (cert_dir / name).is_file():
                raise SystemExit(f"--webhook-cert-dir {cert_dir}: {name} is missing; mount a TLS Secret there "
                                 "or leave the flag out for a self-signed certificate")
        return kopf.WebhookServer(addr=options.webhook_addr, port=options.webhook_port, host=options.webhook_host,
                                  certfile=str(cert_dir / "tls.crt"), pkeyfile=str(cert_dir / "tls.key"))
    return SelfSigningWebhookServer(addr=options.webhook_addr, port=options.webhook_port, host=options.webhook_host)


def build_operator(options: OperatorOptions, metrics: OperatorMetrics | None = None
                   ) -> tuple[kopf.OperatorRegistry, kopf.OperatorSettings, OperatorContext]:
    api = KubeApi(load_configuration(options.kubeconfig, options.context))
    ctx = OperatorContext(api=api, ledger=LedgerStore(api, options.namespace, options.ledger_name),
                          metrics=metrics or OperatorMetrics.create(), resync_seconds=options.resync_seconds,
                          native_mode=options.native_sidecars, usage_seconds=options.usage_seconds,
                          usage_reader=http_reader(url_template(options.index_metrics_url))
                          if options.usage_seconds > 0 else None)
    registry = build_registry(ctx)
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="maru.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="maru.io", key="last-handled-configuration")
    settings.posting.reporting_component = "marucache-operator"
    settings.peering.standalone = True  # the ledger's compare-and-swap keeps replicas safe
    settings.watching.server_timeout = 300
    # How long kopf waits for the watch to bring back its own annotation patch. Past this it runs
    # the change handlers on the older body, which lacks that patch: a new cache is then
    # reconciled a second time. Kopf's default (5 s) outlasts a busy API server's watch lag.
    settings.persistence.consistency_timeout = 5.0
    if options.webhook:
        register_webhook(registry, native=lambda: ctx.native_sidecars,
                         report=lambda pod, reason: report_refusal(ctx, pod, reason))
        settings.admission.server = webhook_server(options)
        if options.webhook_manage:
            settings.admission.managed = "marucache.maru.io"
    return registry, settings, ctx


async def run_operator(options: OperatorOptions, stop_flag: Any = None, ready_flag: Any = None,
                       metrics: OperatorMetrics | None = None) -> None:
    """Run until `stop_flag` is set (or a signal, when in the main thread)."""
    registry, settings, ctx = build_operator(options, metrics)
    server = ctx.metrics.serve(options.metrics_port, options.metrics_addr)[0] if options.metrics_port else None
    try:
        await kopf.operator(registry=registry, settings=settings, clusterwide=True, standalone=True,
                            liveness_endpoint=options.liveness, stop_flag=stop_flag, ready_flag=ready_flag)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        ctx.api.close()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = options_from_args(args)
    try:
        load_configuration(options.kubeconfig, options.context)
    except Exception as exc:  # noqa: BLE001 - any loader failure means "no cluster found"
        logging.error("cannot find a cluster: %s; run in a pod with a service account, set KUBECONFIG, "
                      "or pass --kubeconfig", exc)
        return 2
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run() handles signals and must be called from the main thread")
    asyncio.run(run_operator(options))
    return 0
