"""Helpers for the sidecar tests: real writer processes, a real sidecar process, temp dirs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.fixture
def stats_writers(tmp_path):
    """Factory of writer processes in a directory; all are killed at the end."""
    started: list[StatsWriter] = []

    def start(directory: Path = tmp_path, role: str = "worker") -> StatsWriter:
        writer = StatsWriter(directory, role)
        started.append(writer)
        return writer

    yield start
    for writer in started:
        writer.kill()


def short_tmp_dir(tmp_path_factory) -> Path:
    """A directory whose socket paths fit in sockaddr_un (pytest's tmp paths can be long)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="maru-sc-", dir="/tmp"))


@pytest.fixture
def sock_dir(tmp_path_factory):
    directory = short_tmp_dir(tmp_path_factory)
    yield directory
    for child in directory.iterdir():
        child.unlink()
    os.rmdir(directory)
