"""``DirectLaunch`` without a GPU: the driver's launch replaced by one that
reads back what it was handed, so what reaches ``cuLaunchKernel`` is checked
on any machine (the launches themselves: test_verified_transfer.py, on a GPU)."""

from __future__ import annotations

import ctypes

import pytest

from maru_connector.transfer import direct_launch
from maru_connector.transfer.direct_launch import INT32, POINTER, DirectLaunch

KINDS = (POINTER, POINTER, INT32, INT32, POINTER, INT32)


@pytest.fixture
def launched(monkeypatch):
    """The launches made, each (function, grid, block, shared, stream, arguments read from its parameters)."""
    calls: list[tuple] = []

    def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        kinds = KINDS + (POINTER,) * 2  # the scratch pointers
        values = [ctypes.c_uint64.from_address(params[i]).value if kind == POINTER
                  else ctypes.c_int32.from_address(params[i]).value for i, kind in enumerate(kinds)]
        calls.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, values))
        return 0

    monkeypatch.setattr(direct_launch, "_driver", lambda: (launch, None))
    return calls


def test_the_arguments_reach_the_driver_in_their_slots_and_the_scratch_pointers_stay_null(launched):
    kernel = DirectLaunch(0xABC, KINDS, extra=2, threads=128, shared=64)
    args = [1 << 40, 16, -(1 << 31), (1 << 31) - 1, 0x7F00_0000_0010, 0]
    assert kernel((5, 3), 77, args)
    args2 = [32, 48, 7, -1, 64, 123_456]
    assert kernel((1, 1), 0, args2)
    assert launched == [(0xABC, (5, 3, 1), (128, 1, 1), 64, 77, args + [0, 0]),
                        (0xABC, (1, 1, 1), (128, 1, 1), 64, 0, args2 + [0, 0])]


@pytest.mark.parametrize("args", [
    [8, 16, 0, 0, 32, 0],  # a pointer off 16 bytes: another variant of Triton's
    [16, 16, 1 << 31, 0, 32, 0],  # an integer past 32 bits: Triton's int64 variant
    [16, 16, 0, -(1 << 31) - 1, 32, 0],
    [16, 16, 0, 0, 32],  # an argument missing
    [16, 16, 0, 0],  # a pointer's among them
    [16, 16, 0, 0, 32, 0, 7],  # one too many
], ids=["unaligned", "too-large", "too-small", "missing", "missing-pointer", "extra"])
def test_arguments_the_variant_was_not_compiled_for_launch_nothing(launched, args):
    kernel = DirectLaunch(0xABC, KINDS, extra=2, threads=128, shared=0)
    assert not kernel((1, 1), 0, args) and launched == []
    assert kernel((1, 1), 0, [16, 16, 0, 0, 32, 0]) and len(launched) == 1  # a bad call left nothing behind
