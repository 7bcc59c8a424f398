"""The pod's credential, written where the vLLM container reads its token (``--credential-file``).

The sidecar holds the cache token; the vLLM container gets only this file: a
credential naming the pod (``maru_core.pod_credentials``), which the index
takes as the lease's peer and the sidecar's hand-off accepts from its own pod
only. It is rewritten whenever the token read from ``--token-file`` changes
(a rotated Secret), each time whole: a temporary file beside it, then
``os.replace``, so a reader sees the old credential or the new one, never a
part. Mode 0440, group ``--socket-group`` like the socket: the vLLM
container may read it, nobody may change it in place.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path

from maru_core.pod_credentials import mint

log = logging.getLogger(__name__)

#: Mode of the credential file: readable by the sidecar's user and the socket's group, never written in place.
CREDENTIAL_MODE = 0o440


class CredentialFile:
    """The credential of ``pod`` at ``path``, kept minted with the current cache token."""

    def __init__(self, path: Path, pod: str, gid: int | None = None):
        self.path, self.pod, self._gid = path, pod, gid
        self._minted_with: str | None = None
        self._lock = threading.Lock()  # the hand-off thread and the index probe both refresh it
        self._last_error = ""

    def write(self, cache_token: str) -> None:
        """Write the credential minted with ``cache_token`` now; OSError if it cannot be written."""
        with self._lock:
            self._replace(mint(cache_token, self.pod))
            self._minted_with = cache_token

    def refresh(self, cache_token: str) -> None:
        """Rewrite the credential if ``cache_token`` is not the token it was minted with (a rotated Secret).

        Never raises: a failure is logged (once per reason) and retried at the next token read;
        meanwhile the file keeps the previous credential, which the index and the hand-off refuse.
        """
        if cache_token == self._minted_with:
            return
        try:
            self.write(cache_token)
        except OSError as exc:
            if str(exc) != self._last_error:
                log.error("cannot rewrite the credential of pod %s in %s after the token changed: %s",
                          self.pod, self.path, exc)  # fmt: skip
            self._last_error = str(exc)
            return
        self._last_error = ""
        log.info("the cache token changed: rewrote the credential of pod %s in %s", self.pod, self.path)

    def _replace(self, credential: str) -> None:
        fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                os.fchmod(fh.fileno(), CREDENTIAL_MODE)
                if self._gid is not None:
                    os.fchown(fh.fileno(), -1, self._gid)
                fh.write(credential + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(temp, self.path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
