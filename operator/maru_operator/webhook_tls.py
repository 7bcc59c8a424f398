"""The webhook served with a mounted certificate, renewed in place.

A mounted Secret (cert-manager's, or the chart's own) changes under a running
operator when its certificate is renewed. kopf's server notices changed
files by stopping its listener and starting a new one; while it does, the
API server's calls are refused, and the webhook fails open, so a pod created
then starts without its sidecar. This server instead loads the new
certificate into the SSL context it serves with: handshakes after the
change present it, connections already open keep theirs, and the listener
never closes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import pathlib
import ssl
from collections.abc import AsyncIterator

import kopf

logger = logging.getLogger(__name__)

DEFAULT_CHECK_SECONDS = 10.0  # a kubelet refreshes a mounted Secret about once a minute


class ReloadingWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server for a certificate and key in files that
    may be replaced (``cert_dir``/tls.crt and tls.key), read again every
    ``check_seconds`` and loaded without restarting the listener."""

    def __init__(self, cert_dir: pathlib.Path, *, check_seconds: float = DEFAULT_CHECK_SECONDS,
                 **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]  # kopf's keyword arguments, passed through
        self.cert_path, self.key_path = cert_dir / "tls.crt", cert_dir / "tls.key"
        self.check_seconds = check_seconds
        self.reloads = 0  # certificates loaded after the first
        self._context: ssl.SSLContext | None = None
        self._digest = ""

    def _build_ssl(self) -> tuple[bytes | None, ssl.SSLContext | None]:
        """The context kopf serves with, made once: certfile and pkeyfile
        stay unset, so kopf's own watch of them (a listener restart) never fires."""
        if self._context is None:
            self._context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
            self._load()
        return self.cert_path.read_bytes(), self._context

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        watch = asyncio.create_task(self._watch())
        try:
            async for config in super().__call__(fn):
                yield config
        finally:
            watch.cancel()

    def _load(self) -> bool:
        """Load the files into the context when they changed; False while
        they do not make a pair yet (a Secret halfway replaced): the
        certificate served so far stays."""
        cert, key = self.cert_path.read_bytes(), self.key_path.read_bytes()
        digest = hashlib.sha256(cert + b"\0" + key).hexdigest()
        if digest == self._digest:
            return False
        assert self._context is not None
        try:
            self._context.load_cert_chain(self.cert_path, self.key_path)
        except ssl.SSLError:
            if not self._digest:
                raise  # nothing served yet: the operator must not start with a broken pair
            logger.warning("the webhook certificate in %s does not load yet; serving the previous one",
                           self.cert_path.parent)
            return False
        self._digest = digest
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_seconds)
            try:
                if self._load():
                    self.reloads += 1
                    logger.info("the webhook now serves the renewed certificate in %s", self.cert_path.parent)
            except OSError as exc:  # a file briefly missing while a Secret is swapped
                logger.warning("the webhook certificate could not be read (%s); serving the previous one", exc)
