"""Real processes for the sidecar tests: stats writers, sidecars, hand-off clients."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


HERE = Path(__file__).parent


class StatsWriter:
    """A separate process that owns one stats region (tests/sidecar/stats_writer.py)."""

    def __init__(self, directory: Path, role: str = "worker"):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "stats_writer.py"), str(directory), role],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        first = self.proc.stdout.readline().split()
        if not first or first[0] != "ready":
            raise RuntimeError(f"stats writer did not start: {first}")
        self.path = Path(first[1])

    def do(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"stats writer: {command!r} -> {answer!r}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class SidecarProcess:
    """A real `marucache sidecar` process; its endpoints on 127.0.0.1."""

    def __init__(self, pool: str, socket_path: Path, index_url: str, *, token_file: str | None = None,
                 cache: str = "c1", port: int = 0, env: dict[str, str] | None = None):  # fmt: skip
        self.socket_path = socket_path
        self.port = port
        self.log_path = socket_path.parent.parent / f"{socket_path.parent.name}-sidecar-{os.getpid()}.log"
        self.cmd = [
            sys.executable, "-m", "maru_core.cli", "sidecar", "--pool", pool, "--socket", str(socket_path),
            "--index", index_url, "--cache", cache, "--metrics-host", "127.0.0.1",
            "--index-timeout", "0.5", *(["--token-file", token_file] if token_file else []),
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

    def terminate(self, timeout_s: float = 10.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def close(self) -> None:
        self.kill()
        self.log_path.unlink(missing_ok=True)


def run_client(socket_path: Path, cache: str, token: str | None) -> dict:
    """Run tests/sidecar/handoff_client.py once; its JSON answer."""
    out = subprocess.run(
        [sys.executable, str(HERE / "handoff_client.py"), str(socket_path), cache, token or "-"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"hand-off client failed:\n{out.stderr}")
    return json.loads(out.stdout.splitlines()[0])


class HoldingClient:
    """A hand-off client that keeps its mapping and reads through it on request."""

    def __init__(self, socket_path: Path, cache: str, token: str | None):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "handoff_client.py"), str(socket_path), cache, token or "-", "--hold"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.info = json.loads(self.proc.stdout.readline())

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()
