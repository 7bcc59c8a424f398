"""Launch a compiled Triton kernel with one call into the CUDA driver.

A verified load launches the checksum kernel once per staging fill, on the
engine thread, and a 4k-token hit has 32 fills: Triton's launch (argument
binding, the variant's cache lookup, its C launcher) took 27-37 us of host
time per call on an H200 host, most of what verification added to such a
hit (bench/RESULTS.md, "Verified loads"). Here a variant compiled once is
launched with ``cuLaunchKernel`` through ctypes over argument slots made
ahead, a few microseconds.

Only what can be checked is launched so: the kernel's parameters, as the
driver reports them (``cuFuncGetParamInfo``), must be the declared ones
followed by Triton's scratch pointers, which must need no memory (passed as
null); the variant must be the one compiled for 16-byte aligned pointers,
so every pointer passed is checked for that alignment and every integer for
fitting 32 bits (Triton compiles other variants for other values). A call
that does not fit returns False and the caller launches through Triton.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from collections.abc import Sequence

__all__ = ["DirectLaunch", "direct_launch"]

POINTER, INT32 = "p", "i"  # the declared kinds of a kernel's parameters
_SIZES = {POINTER: 8, INT32: 4}
# Each argument in a slot of 8 bytes of one buffer: a pointer as uint64, an
# integer as int32 and 4 bytes of padding (``struct`` refuses one out of range).
_SLOT_FORMATS = {POINTER: "Q", INT32: "i4x"}
_NO_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: nothing was launched
_MAX_PARAMS = 64  # more than any kernel here: the query stops at the first index past the end


def _libcuda():
    """The CUDA driver's two entry points used here, or None where the
    library or ``cuFuncGetParamInfo`` (driver 12.4 and later) is missing."""
    try:
        # PyDLL: the call keeps the interpreter lock. A launch takes a few
        # microseconds; giving the lock up for it could cost the issuing
        # thread a switch interval behind another thread.
        lib = ctypes.PyDLL("libcuda.so.1")
        launch, param_info = lib.cuLaunchKernel, lib.cuFuncGetParamInfo
    except (OSError, AttributeError):
        return None
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    param_info.restype = ctypes.c_int
    param_info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                           ctypes.POINTER(ctypes.c_size_t)]
    return launch, param_info


_driver = functools.cache(_libcuda)  # loaded at the first use, once


def param_sizes(function: int) -> list[int] | None:
    """The byte size of each parameter of a loaded kernel, as the driver has it."""
    driver = _driver()
    if driver is None:
        return None
    _, param_info = driver
    sizes: list[int] = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    for index in range(_MAX_PARAMS):
        if param_info(function, index, ctypes.byref(offset), ctypes.byref(size)) != 0:
            return sizes  # the first index past the last parameter
        sizes.append(size.value)
    return None


class DirectLaunch:
    """One compiled variant, launched through ``cuLaunchKernel``. Each
    thread gets its own argument slots, so two threads may launch at once.

    The arguments go into their slots in one ``struct`` call, which also
    refuses an integer past 32 bits: 1.0 us of the issuing thread's time for
    the checksum kernel's 19 arguments, where setting ctypes values one by
    one with a check each took 2.5 us (a 2-core VM, the driver's call left out)."""

    def __init__(self, function: int, kinds: Sequence[str], extra: int, threads: int, shared: int) -> None:
        self.function = function
        self.kinds = tuple(kinds)
        self.extra = extra  # trailing null pointers (Triton's scratch)
        self.threads = threads
        self.shared = shared
        self._pack = struct.Struct("=" + "".join(_SLOT_FORMATS[k] for k in self.kinds)).pack_into
        self._pointers = tuple(i for i, k in enumerate(self.kinds) if k == POINTER)
        self._local = threading.local()
        self._launch = _driver()[0]

    def _slots(self):
        """This thread's (slot buffer, parameter array): one 8-byte slot per
        argument, then the scratch pointers' (zero, for ever)."""
        slots = getattr(self._local, "slots", None)
        if slots is None:
            count = len(self.kinds) + self.extra
            buffer = (ctypes.c_uint64 * count)()
            base = ctypes.addressof(buffer)
            params = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
            slots = self._local.slots = (buffer, params)
        return slots

    def __call__(self, grid: tuple[int, int], stream: int, args: Sequence[int]) -> bool:
        """Launch on ``grid`` (x, y) on ``stream`` (a ``cudaStream_t`` as an
        int), or return False, launching nothing, where the compiled variant
        is not the one these arguments would pick: a pointer not on 16 bytes,
        an integer past 32 bits."""
        if len(args) != len(self.kinds) or any(args[i] % 16 for i in self._pointers):
            return False
        buffer, params = self._slots()
        try:
            self._pack(buffer, 0, *args)
        except struct.error:
            return False
        error = self._launch(self.function, grid[0], grid[1], 1, self.threads, 1, 1, self.shared, stream,
                             params, None)
        if error == _NO_CONTEXT:  # a thread that never used CUDA: Triton's launch makes one current
            return False
        if error != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA driver error {error}")
        return True


def direct_launch(compiled, kinds: Sequence[str]) -> tuple[DirectLaunch | None, str]:
    """A ``DirectLaunch`` of a Triton ``CompiledKernel`` whose declared
    parameters are ``kinds``, or None and why not."""
    if _driver() is None:
        return None, "the CUDA driver has no cuFuncGetParamInfo (driver 12.4 or later needed)"
    meta = compiled.metadata
    if getattr(meta, "num_ctas", 1) != 1 or tuple(getattr(meta, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) != (1, 1, 1):
        return None, "the kernel is compiled for clusters"
    if getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False):
        return None, "the kernel needs a cooperative or programmatic launch"
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return None, "the kernel needs scratch memory"
    function = getattr(compiled, "function", None)
    if not function:
        return None, "the kernel is not loaded"
    sizes = param_sizes(function)
    want = [_SIZES[k] for k in kinds]
    if sizes is None or sizes[:len(want)] != want or any(s != 8 for s in sizes[len(want):]):
        return None, f"its parameters are {sizes} bytes, not the declared {want} and scratch pointers"
    threads = meta.num_warps * getattr(meta, "warp_size", 32)
    return DirectLaunch(function, kinds, len(sizes) - len(want), threads, meta.shared), ""
