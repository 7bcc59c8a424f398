"""Fixtures of the sidecar tests: writer processes and short temporary directories."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest
from sidecar_helpers import StatsWriter

from maru_core.pool import Pool
from maru_tools.sidecar_process import SidecarProcess


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


@pytest.fixture
def sock_dir():
    """A directory for the socket whose paths fit in sockaddr_un (pytest's tmp paths can be too long)."""
    directory = Path(tempfile.mkdtemp(prefix="maru-sc-", dir="/tmp"))
    yield directory
    for child in directory.iterdir():
        child.unlink()
    os.rmdir(directory)


@pytest.fixture
def sidecars():
    """Factory of sidecar processes (``SidecarProcess`` arguments), started; all closed at the end."""
    started: list[SidecarProcess] = []

    def start(*args, **kwargs) -> SidecarProcess:
        process = SidecarProcess(*args, **kwargs)
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.close()


@pytest.fixture
def pool_path():
    path = f"/dev/shm/maru-sidecar-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


@pytest.fixture
def pool(pool_path):
    """An 8 MiB pool file in /dev/shm, removed at the end."""
    with Pool.create(pool_path, size=8 * 1024 * 1024) as created:
        yield created
