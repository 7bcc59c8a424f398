"""The connector tests' ``FakeClient`` stays an ``IndexApi``, as ``IndexClient`` is.

The connector is typed against ``maru_core.index.api.IndexApi``; a fake that
drifts from it (a renamed keyword, a missing method, another result type)
would let connector code pass its unit tests against calls the real client
does not accept. mypy checks ``fake_index_seam.py``, which hands both
clients out as ``IndexApi``.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from maru_core.index.api import IndexApi
from maru_core.index.client import IndexClient

from fake_index import FakeClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _protocol_methods() -> list[str]:
    return [name for name, member in vars(IndexApi).items()
            if not name.startswith("_") and (callable(member) or isinstance(member, property))]


def _parameters(function: Callable[..., object]) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_mypy_accepts_both_clients_as_the_seam(tmp_path):
    env = {**os.environ, "MYPYPATH": os.pathsep.join([str(ROOT / "core"), str(HERE)])}
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
         "--no-error-summary", "--cache-dir", str(tmp_path / "mypy-cache"), str(HERE / "fake_index_seam.py")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, f"the clients no longer implement IndexApi:\n{result.stdout}{result.stderr}"


def test_every_operation_of_the_seam_has_the_same_signature_on_both_clients():
    """The quick check of the same: each ``IndexApi`` method's parameters (names,
    kinds, defaults) on the fake and on the real client."""
    names = _protocol_methods()
    assert {"retrieve", "unpin", "reserve", "commit", "abort", "timeout_s"} <= set(names)
    fake, real = FakeClient.__new__(FakeClient), IndexClient("tcp://127.0.0.1:1")
    try:
        for name in names:
            if isinstance(vars(IndexApi)[name], property):
                assert isinstance(getattr(fake, name), float) and isinstance(getattr(real, name), float)
                continue
            wanted = _parameters(getattr(IndexApi, name))[1:]  # less self
            for client in (fake, real):
                got = _parameters(getattr(client, name))
                assert got == wanted, f"{type(client).__name__}.{name}{got} is not IndexApi.{name}{wanted}"
    finally:
        real.close()
