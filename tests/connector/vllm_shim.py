"""vLLM's two connector base classes the connector's messages derive from,
for machines where vLLM itself cannot be installed (the GPU machine: vLLM's
CUDA build needs another torch than the one there).

``install()`` does nothing when vLLM is importable. Otherwise it registers
modules that hold only ``KVConnectorMetadata`` and
``KVConnectorWorkerMetadata``, empty classes as in vLLM, so that the
connector's scheduler and worker halves import; nothing else of vLLM is
stood in for.
"""

from __future__ import annotations

import importlib.util
import sys
import types

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def install() -> bool:
    """True when the stand-in was installed (vLLM is not importable)."""
    if _BASE in sys.modules or importlib.util.find_spec("vllm") is not None:
        return False
    parts = _BASE.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = sys.modules.setdefault(name, types.ModuleType(name))
        module.__path__ = []  # a package, so the next part imports
        if i > 1:
            setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], module)
    base = sys.modules[_BASE]

    class KVConnectorMetadata:  # noqa: D401 - as in vLLM: a marker base class
        """Scheduler -> worker metadata (vLLM's base class)."""

    class KVConnectorWorkerMetadata:
        """Worker -> scheduler metadata (vLLM's base class)."""

    base.KVConnectorMetadata = KVConnectorMetadata
    base.KVConnectorWorkerMetadata = KVConnectorWorkerMetadata
    return True
