"""Checks for the whole test tree."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis's timing checks (an example's deadline, slow input generation)
# judge the machine, not the code: on a busy 2-core CI machine the first
# examples of a session took 1.9 s to draw and failed the run. Properties
# are still checked on every example drawn.
settings.register_profile("marucache", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("marucache")


def pytest_configure(config: pytest.Config) -> None:
    """A run meant for another vLLM release (scripts/test_vllm_release.sh)
    must really import that release, not the CPU build beside it."""
    expected = os.environ.get("MARUCACHE_EXPECT_VLLM")
    if expected:
        import vllm

        if vllm.__version__ != expected:
            raise pytest.UsageError(f"expected vLLM {expected} on the path, found {vllm.__version__} "
                                    f"at {vllm.__file__}")


@pytest.fixture(autouse=True)
def _connector_warnings_not_held_back():
    """The connector collapses repeated warnings process-wide (maru_connector.log): a test
    asserting one must not find it held back because an earlier test logged its kind."""
    log = sys.modules.get("maru_connector.log")
    if log is not None:
        log.repeats.reset()
    yield
