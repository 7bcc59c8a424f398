"""Per-pod credentials: a pod's own token, minted from the cache's token.

Every pod of a cache used to present the cache's one token, so the index
could tell its clients apart only by address, and pods behind one address
(a NAT, hostNetwork pods) shared one peer's quotas and fair share. A pod
credential names its pod and carries an HMAC of that name under the cache
token:

    maru-pod-v1:<namespace>/<pod name>:<hex HMAC-SHA256(cache token, name)>

The sidecar, which holds the cache token, mints its own pod's credential and
writes it where the vLLM container reads its token; the vLLM container no
longer sees the cache token, so it cannot mint another pod's name. The
index checks the HMAC with the cache token and takes the pod as the peer of
the lease (quotas, fair share, turns), whatever the address it comes from.
A credential is presented wherever the token was (``hello``, the hand-off),
so the connector needs no change. The cache token still works (the sidecar
itself, the embedded default): its clients are told apart by address.
"""

from __future__ import annotations

import hashlib
import hmac
import re

PREFIX = "maru-pod-v1"
_DOMAIN = b"maru.pod-credential.v1\0"  # a MAC of this kind can mean nothing else
# namespace/name: DNS labels and subdomains (what Kubernetes allows), or any short name alike
_POD = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,252})/[A-Za-z0-9]([A-Za-z0-9._-]{0,252})")


def check_pod(pod: str) -> str:
    """``pod`` if it is a ``namespace/name`` a credential may carry, else ValueError saying why."""
    if not _POD.fullmatch(pod):
        raise ValueError(f"pod identity {pod[:80]!r} is not NAMESPACE/NAME (letters, digits, '.', '_', '-'; "
                         "each part at most 253 characters, starting with a letter or digit)")
    return pod


def mint(cache_token: str, pod: str) -> str:
    """The credential of ``pod`` (``namespace/name``) under ``cache_token``."""
    return f"{PREFIX}:{check_pod(pod)}:{_mac(cache_token, pod)}"


def pod_of(cache_token: str, credential: str) -> str | None:
    """The pod ``credential`` names when it is a credential minted with ``cache_token``, else None
    (a malformed one, another cache's, or a forged name)."""
    prefix, _, rest = credential.partition(":")
    pod, _, mac = rest.rpartition(":")
    if prefix != PREFIX or not _POD.fullmatch(pod):
        return None
    return pod if hmac.compare_digest(mac.encode(), _mac(cache_token, pod).encode()) else None


def is_credential(text: str) -> bool:
    """Whether ``text`` has the form of a pod credential (says nothing of its MAC)."""
    return text.startswith(PREFIX + ":")


def _mac(cache_token: str, pod: str) -> str:
    return hmac.new(cache_token.encode(), _DOMAIN + pod.encode(), hashlib.sha256).hexdigest()
