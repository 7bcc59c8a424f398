"""Fixtures shared by the core tests."""

import os

import pytest

from maru_core.index.launcher import unique_shm_path
from maru_core.pool import Pool


@pytest.fixture
def make_pool():
    """``make_pool(name, size, page_size)``: a fresh pool file in ``/dev/shm``
    (or the temp dir), closed and removed after the test."""
    made = []

    def make(name: str, size: int, page_size: int) -> Pool:
        path = unique_shm_path(name)
        made.append((Pool.create(path, size, page_size=page_size), path))
        return made[-1][0]

    yield make
    for pool, path in made:
        pool.close()
        os.unlink(path)


@pytest.fixture
def pool_path():
    """A fresh path for a pool file in ``/dev/shm``, removed after the test."""
    path = unique_shm_path("test-index")
    yield path
    if os.path.exists(path):
        os.unlink(path)


@pytest.fixture
def token_file(tmp_path, request):
    """The test module's ``TOKEN`` in a file only its owner reads, as the index requires."""
    path = tmp_path / "token"
    path.write_text(request.module.TOKEN + "\n")
    path.chmod(0o600)
    return str(path)
