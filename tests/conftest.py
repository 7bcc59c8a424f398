"""Checks for the whole test tree."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """A run meant for another vLLM release (scripts/test_vllm_release.sh)
    must really import that release, not the CPU build beside it."""
    expected = os.environ.get("MARUCACHE_EXPECT_VLLM")
    if expected:
        import vllm

        if vllm.__version__ != expected:
            raise pytest.UsageError(f"expected vLLM {expected} on the path, found {vllm.__version__} "
                                    f"at {vllm.__file__}")
