"""The mutating admission webhook (thin: the logic is in `injection`).

TLS: in a real cluster the API server only calls HTTPS webhooks. Either
mount a certificate (a Secret, e.g. from cert-manager) and pass
`--webhook-cert-dir` (files `tls.crt`, `tls.key`), or let the operator make
a self-signed one at start (kopf's scheme, generated with `cryptography`);
with `--webhook-manage` kopf then writes the CA into the
MutatingWebhookConfiguration it manages.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import ipaddress
import logging
from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import Any

import kopf

from . import LABEL_CACHE
from .injection import decide
from .pods import core_event
from .results import EventType

logger = logging.getLogger(__name__)
WEBHOOK_ID = "inject"


Report = Callable[[Mapping[str, Any], str], Coroutine[Any, Any, None]]


def register_webhook(registry: kopf.OperatorRegistry, native: Callable[[], bool] = lambda: False,
                     report: Report | None = None) -> None:
    """Add the pod-injection handler (endpoint path `/inject`).

    `native()` says whether the cluster runs native sidecars; `report(pod, reason)`
    posts the Event of a pod that could not be injected.
    """
    reporting: set[asyncio.Task[None]] = set()  # Events being posted (kept referenced until done)

    @kopf.on.mutate("", "v1", "pods", id=WEBHOOK_ID, operations=["CREATE"], labels={LABEL_CACHE: kopf.PRESENT},
                    side_effects=False, ignore_failures=True, registry=registry)
    async def inject(body: kopf.Body, patch: kopf.Patch, maru_caches: Any = None, **_: Any) -> None:
        meta = body.get("metadata") or {}
        name = str((meta.get("labels") or {}).get(LABEL_CACHE))
        namespace = meta.get("namespace") or "default"
        store = maru_caches.get((namespace, name)) if maru_caches is not None else None
        info = next(iter(store), None) if store else None
        decision = decide(body, name, info, native=native())
        for key, value in decision.patch.items():
            patch[key] = value
        if decision.refused:
            logger.warning("pod %s/%s not injected: %s", namespace, meta.get("name") or meta.get("generateName"),
                           decision.reason)
            if report is not None:  # in the background: the API server waits for this answer
                task = asyncio.create_task(report(copy.deepcopy(dict(body)), decision.reason))
                reporting.add(task)
                task.add_done_callback(reporting.discard)


def refusal_event(pod: Mapping[str, Any], reason: str, now: str) -> dict[str, Any] | None:
    """A Warning Event about a pod the webhook could not inject, on the pod (or, while a controller's
    pod has no name yet, on its owner); None when there is nothing to attach it to."""
    meta = pod.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    if meta.get("name"):
        involved = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": namespace}
    else:
        owner = next(iter(meta.get("ownerReferences") or ()), None)
        if owner is None:
            return None
        involved = {"apiVersion": owner.get("apiVersion"), "kind": owner.get("kind"), "name": owner.get("name"),
                    "uid": owner.get("uid"), "namespace": namespace}
    return core_event(involved, EventType.WARNING, "InjectionSkipped", f"MaruCache sidecar not injected: {reason}", now)


class SelfSigningWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server, making its self-signed certificate with `cryptography`."""

    @staticmethod
    def build_certificate(hostnames: Collection[str], password: str | None = None) -> tuple[bytes, bytes]:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ips, names = [], []
        for host in hostnames:
            try:
                ip = ipaddress.ip_address(host)
                if not ip.is_unspecified:
                    ips.append(ip)
            except ValueError:
                names.append(host)
        common_name = names[0] if names else str(ips[0])
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        sans = [x509.DNSName(n) for n in dict.fromkeys(names)] + [x509.IPAddress(i) for i in dict.fromkeys(ips)]
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=365))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(key, hashes.SHA256()))
        encryption = (serialization.BestAvailableEncryption(password.encode()) if password
                      else serialization.NoEncryption())
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
