"""A real `marucache sidecar` process on a pool, for tests, `marucache demo` and benchmarks.

The sidecar serves the pool on a Unix socket; its directory is the stats
directory where every connector process that fetched the pool writes its
counters (`maru_core.stats`), and the sidecar exports their sum on
`/metrics`. Its endpoints listen on 127.0.0.1, on a free port unless one is
given.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class SidecarProcess:
    """A real `marucache sidecar` process; its endpoints on 127.0.0.1."""

    def __init__(self, pool: str, socket_path: Path, index_url: str, *, token_file: str | None = None,
                 cache: str = "c1", port: int = 0, env: dict[str, str] | None = None,
                 pool_offset: str | None = None, log_path: Path | None = None,
                 credential_file: Path | None = None, pod: str | None = None):  # fmt: skip
        """``credential_file``: where the sidecar writes its pod's credential (``--credential-file``);
        ``pod``: ``[NAMESPACE/]NAME`` (``--pod``; default: ``$POD_NAMESPACE``/``$POD_NAME`` of ``env``)."""
        self.socket_path = socket_path
        self.credential_file = credential_file
        self.port = port
        self.log_path = log_path or socket_path.parent.parent / f"{socket_path.parent.name}-sidecar-{os.getpid()}.log"
        self.cmd = [
            sys.executable, "-m", "maru_core.cli", "sidecar", "--pool", pool, "--socket", str(socket_path),
            "--index", index_url, "--cache", cache, "--metrics-host", "127.0.0.1",
            "--index-timeout", "0.5", *(["--token-file", token_file] if token_file else []),
            *(["--pool-offset", pool_offset] if pool_offset is not None else []),
            *(["--credential-file", str(credential_file)] if credential_file is not None else []),
            *(["--pod", pod] if pod is not None else []),
        ]  # fmt: skip
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> "SidecarProcess":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*self.cmd, "--metrics-port", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, env=self.env)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_text().splitlines():
                if line.startswith("marucache sidecar: cache"):
                    self.port = int(line.rsplit(":", 1)[1].split("/")[0])
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {self.proc.returncode}:\n{self.log_text()}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"sidecar did not start within {timeout_s} s:\n{self.log_text()}")

    @property
    def stats_dir(self) -> Path:
        """Where the connectors that fetched the pool from this sidecar write their counters."""
        return self.socket_path.parent

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The samples of `/metrics`: (name, sorted labels) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        code, body = self.get("/metrics")
        if code != 200:
            raise RuntimeError(f"sidecar /metrics answered {code}: {body[:200]}")
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body)
            for sample in family.samples
        }

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def wait_ready(self, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            code, body = self.get("/readyz")
            if code == 200:
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"sidecar not ready after {timeout_s} s: {body}\n{self.log_text()}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the sidecar removes its socket and exits), SIGKILL if it has not exited in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def terminate(self, timeout_s: float = 10.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def close(self) -> None:
        self.kill()
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> "SidecarProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
