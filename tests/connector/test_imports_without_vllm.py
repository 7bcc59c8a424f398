"""Both connector halves import on the GPU machine, where vLLM cannot be installed.

The GPU benchmarks and CUDA tests import the worker, the loader, the store
and the CUDA engine, and the GPU harness drives the scheduler half, with
only `vllm_shim`'s two base classes standing in for vLLM; a module-level
import of anything else of vLLM on that path stops every GPU run before it
starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCRIPT = """
import importlib.util, sys

class NoVllm:  # as on the GPU machine: vLLM is not installed
    def find_spec(self, name, path=None, target=None):
        if (name == "vllm" or name.startswith("vllm.")) and name not in sys.modules:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoVllm())
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *args: None if name == "vllm" else find_spec(name, *args)
import vllm_shim
assert vllm_shim.install()
import maru_connector.loader, maru_connector.store, maru_connector.worker
import maru_connector.transfer.cuda, maru_connector.transfer.factory
import maru_connector.scheduler
"""


def test_both_halves_and_the_cuda_engine_import_with_only_the_shim():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
