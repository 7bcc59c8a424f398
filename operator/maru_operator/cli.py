"""`marucache operator`: the composition root of the operator process.

Builds the API client, the ledger store, the metrics registry and the kopf
registry and settings once, and runs kopf cluster-wide, or in the namespaces
of `--watch-namespace` (`scope`). The same
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
import socket
import threading
import time
import urllib.parse
from typing import Any

import kopf

from . import FINALIZER
from .handlers import OperatorContext, build_registry, build_standby_registry, report_refusal
from .k8s import KubeApi, LedgerStore, load_configuration
from .leader import LeaseElector
from .metrics import OperatorMetrics
from .models import DEFAULT_IMAGE
from .scope import Scope, parse_namespaces, wait_until_served
from .usage import DEFAULT_URL_TEMPLATE, http_reader, url_template
from .webhook import SelfSigningWebhookServer, register_webhook
from .webhook_tls import DEFAULT_CHECK_SECONDS, ReloadingWebhookServer


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
    default_image: str = DEFAULT_IMAGE
    webhook_cert_check_seconds: float = DEFAULT_CHECK_SECONDS
    webhook_insecure: bool = False
    webhook_manage: bool = False
    liveness: str | None = None
    native_sidecars: str = "auto"
    usage_seconds: float = 30.0
    index_metrics_url: str = DEFAULT_URL_TEMPLATE
    leader_election: bool = False
    lease_name: str = "marucache-operator"
    lease_seconds: float = 15.0
    identity: str = ""  # empty: $POD_NAME, else the host name
    watch_namespaces: tuple[str, ...] = ()  # empty: every namespace (cluster-wide)


class LeadershipLost(RuntimeError):
    """This replica stopped reconciling because it could not keep the Lease; restart it to wait again."""


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
    parser.add_argument("--default-image", default=d.default_image,
                        help="image of the index and the sidecar of every cache that names none (the chart "
                             "passes its own image, so an upgrade moves those caches to the new one)")
    parser.add_argument("--webhook-cert-check-seconds", type=float, default=d.webhook_cert_check_seconds,
                        help="how often the files of --webhook-cert-dir are read again; a renewed certificate "
                             "is served from the next handshake on, without closing the listener")
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
    parser.add_argument("--leader-election", action="store_true",
                        help="reconcile only while holding the Lease --lease-name in --namespace (run several "
                             "replicas; the others serve the webhook and wait)")
    parser.add_argument("--lease-name", default=d.lease_name, help="name of the leader election Lease")
    parser.add_argument("--lease-seconds", type=float, default=d.lease_seconds,
                        help="how long a Lease nobody renews stays held before another replica takes it over")
    parser.add_argument("--identity", default=os.environ.get("POD_NAME", d.identity),
                        help="this replica's name in the Lease (default: $POD_NAME, else the host name)")
    parser.add_argument("--watch-namespace", dest="watch_namespaces", action="append", default=[],
                        type=_namespaces_argument, metavar="NS[,NS...]",
                        help="serve only the MaruCaches (and watch only the pods and Deployments) of these "
                             "namespaces; repeat it or separate names by commas. Default: every namespace")


def _namespaces_argument(value: str) -> tuple[str, ...]:
    try:
        names = parse_namespaces([value])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not names:
        raise argparse.ArgumentTypeError(f"{value!r} names no namespace; leave the flag out to serve every namespace")
    return names


def options_from_args(args: argparse.Namespace) -> OperatorOptions:
    fields = {f.name for f in dataclasses.fields(OperatorOptions)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    if "watch_namespaces" in values:  # one tuple per --watch-namespace
        values["watch_namespaces"] = parse_namespaces(",".join(group) for group in values["watch_namespaces"])
    return OperatorOptions(**values)


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
        return ReloadingWebhookServer(cert_dir, check_seconds=options.webhook_cert_check_seconds,
                                      addr=options.webhook_addr, port=options.webhook_port, host=options.webhook_host)
    return SelfSigningWebhookServer(addr=options.webhook_addr, port=options.webhook_port, host=options.webhook_host)


def build_operator(options: OperatorOptions, metrics: OperatorMetrics | None = None, standby: bool = False
                   ) -> tuple[kopf.OperatorRegistry, kopf.OperatorSettings, OperatorContext]:
    """The operator's kopf registry, settings and shared context; `standby`: only the webhook and what
    it reads (a replica waiting for leadership)."""
    api = KubeApi(load_configuration(options.kubeconfig, options.context))
    scope = Scope(parse_namespaces(options.watch_namespaces))
    ctx = OperatorContext(api=api, ledger=LedgerStore(api, options.namespace, options.ledger_name), scope=scope,
                          metrics=metrics or OperatorMetrics.create(), resync_seconds=options.resync_seconds,
                          default_image=options.default_image,
                          native_mode=options.native_sidecars, usage_seconds=options.usage_seconds,
                          usage_reader=http_reader(url_template(options.index_metrics_url))
                          if options.usage_seconds > 0 else None)
    registry = build_standby_registry(ctx) if standby else build_registry(ctx)
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="maru.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="maru.io", key="last-handled-configuration")
    settings.posting.reporting_component = "marucache-operator"
    # No kopf peering: it pauses every watch of a replica that is not the highest priority (the webhook's
    # index then goes stale) and lets replicas of equal priority all run; a Lease elects (leader.py).
    settings.peering.standalone = True
    settings.watching.server_timeout = 300
    # How long kopf waits for the watch to bring back its own annotation patch. Past this it runs
    # the change handlers on the older body, which lacks that patch: a new cache is then
    # reconciled a second time. Kopf's default (5 s) outlasts a busy API server's watch lag.
    settings.persistence.consistency_timeout = 5.0
    # Namespaced: no watch of every namespace and every CRD (cluster-wide reads), see scope.py.
    settings.scanning.disabled = not scope.cluster_wide
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
    metrics = metrics or OperatorMetrics.create()
    server = metrics.serve(options.metrics_port, options.metrics_addr)[0] if options.metrics_port else None
    try:
        if options.leader_election:
            await run_elected(options, metrics, stop_flag, ready_flag)
        else:
            metrics.leader.set(1)
            await run_kopf(options, metrics, stop_flag, ready_flag)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


async def run_kopf(options: OperatorOptions, metrics: OperatorMetrics, stop_flag: Any, ready_flag: Any,
                   standby: bool = False) -> None:
    registry, settings, ctx = build_operator(options, metrics, standby)
    try:
        # Namespaced, kopf serves only what discovery lists at its start: wait for the MaruCache resource.
        if not ctx.scope.cluster_wide and not await _served_unless_stopped(ctx.api, stop_flag):
            return
        await kopf.operator(registry=registry, settings=settings, clusterwide=ctx.scope.cluster_wide,
                            namespaces=list(ctx.scope.namespaces), standalone=True,
                            liveness_endpoint=options.liveness, stop_flag=stop_flag, ready_flag=ready_flag)
    finally:
        ctx.api.close()


async def _flag_set(flag: Any) -> None:
    """Return once `flag` (a threading or asyncio Event, or None: never) is set."""
    if isinstance(flag, asyncio.Event):
        await flag.wait()
        return
    while flag is None or not flag.is_set():
        await asyncio.sleep(0.1)


async def _first(*tasks: asyncio.Task[Any]) -> set[asyncio.Task[Any]]:
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    return done


async def _served_unless_stopped(api: KubeApi, stop_flag: Any) -> bool:
    """Wait until the MaruCache resource is served (True) or `stop_flag` is set (False)."""
    served = asyncio.create_task(wait_until_served(api))
    stopping = asyncio.create_task(_flag_set(stop_flag))
    try:
        return served in await _first(served, stopping)
    finally:
        for task in (served, stopping):
            task.cancel()
        await asyncio.gather(served, stopping, return_exceptions=True)


def _listen_addresses(options: OperatorOptions) -> list[tuple[str, int]]:
    """The (host, port) pairs a kopf run listens on: the liveness endpoint and the webhook."""
    pairs = []
    if options.liveness:
        url = urllib.parse.urlsplit(options.liveness)
        pairs.append((url.hostname or "0.0.0.0", url.port or 80))
    if options.webhook:
        pairs.append((options.webhook_addr, options.webhook_port))
    return pairs


async def _ports_released(options: OperatorOptions, timeout: float = 10.0) -> None:
    """Wait until a stopped kopf run's servers have let go of their ports (their cleanup may
    outlast the run by a moment), so that the next run can bind them."""
    deadline = time.monotonic() + timeout
    for host, port in _listen_addresses(options):
        while True:
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((host, port))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        return  # the next run reports the clash itself
            await asyncio.sleep(0.1)


async def _wait_for_leadership(options: OperatorOptions, metrics: OperatorMetrics, ready_flag: Any,
                               leads: asyncio.Task[Any], stopping: asyncio.Task[Any]) -> None:
    """Serve the webhook from a waiting kopf run until the Lease is ours (or a stop)."""
    metrics.leader.set(0)
    phase_stop = asyncio.Event()
    waiting = asyncio.create_task(run_kopf(options, metrics, phase_stop, ready_flag, standby=True))
    await _first(waiting, leads, stopping)
    phase_stop.set()
    await waiting
    await _ports_released(options)


async def run_elected(options: OperatorOptions, metrics: OperatorMetrics, stop_flag: Any, ready_flag: Any) -> None:
    """Serve the webhook while waiting for the Lease, then reconcile while holding it.

    Leadership lost (not renewed within the deadline, or taken over) ends the process with
    `LeadershipLost`: a replica that may have missed renewals never reconciles again until it has
    been restarted and has won the Lease anew. A clean stop hands the Lease back."""
    api = KubeApi(load_configuration(options.kubeconfig, options.context))
    seconds = options.lease_seconds
    elector = LeaseElector(api, options.namespace, options.lease_name, options.identity or socket.gethostname(),
                           lease_seconds=seconds, renew_deadline_seconds=seconds * 2 / 3,
                           retry_seconds=seconds * 2 / 15)
    # Every task of the election exists before kopf starts: kopf waits at its exit for the tasks
    # created while it ran, and an election task lives on across both kopf runs.
    # A free Lease is taken before any kopf run, so a lone replica starts as the leader at once.
    acquired = asyncio.Event()
    if await elector.attempt():
        acquired.set()
        electing = asyncio.create_task(elector.hold())
    else:
        electing = asyncio.create_task(elector.run(acquired))
    leads = asyncio.create_task(acquired.wait())
    stopping = asyncio.create_task(_flag_set(stop_flag))
    try:
        if not acquired.is_set():
            await _wait_for_leadership(options, metrics, ready_flag, leads, stopping)
        if not acquired.is_set() or stopping.done():  # stopped (a flag, or a signal kopf handled)
            electing.cancel()
            if acquired.is_set():
                await elector.release()
            return
        metrics.leader.set(1)
        phase_stop = asyncio.Event()
        leading = asyncio.create_task(run_kopf(options, metrics, phase_stop, ready_flag))
        done = await _first(leading, electing, stopping)
        phase_stop.set()
        await leading
        metrics.leader.set(0)
        if electing in done:
            raise LeadershipLost(f"lost the Lease {options.namespace}/{options.lease_name}; restarting to wait")
        electing.cancel()
        await elector.release()
    finally:
        for task in (electing, leads, stopping):
            task.cancel()
        api.close()


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
    try:
        asyncio.run(run_operator(options))
    except LeadershipLost as exc:
        logging.error("%s", exc)
        return 1
    return 0
