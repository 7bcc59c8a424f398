"""The few CUDA runtime calls torch does not wrap: host registration (through
``torch.cuda.cudart()``), strided 2-D copies (``cudaMemcpy2DAsync``) and plain
copies (``cudaMemcpyAsync``), both from the CUDA runtime library already
loaded in the process, else CuPy. A raw call costs a few microseconds of host
time where ``Tensor.copy_`` costs tens: small loads are bound by that time."""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import torch

__all__ = ["H2D", "D2H", "find_memcpy", "find_memcpy2d", "register_host", "unregister_host"]

H2D, D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered

# (dst, dpitch, src, spitch, width, height, kind, stream) -> None
Memcpy2D = Callable[[int, int, int, int, int, int, int, int], None]
# (dst, src, nbytes, kind, stream) -> None
Memcpy = Callable[[int, int, int, int, int], None]


def register_host(ptr: int, size: int) -> bool:
    """Page-lock ``size`` bytes at ``ptr`` for DMA; False when they already
    were (someone else owns the registration)."""
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
    if err == _ALREADY_REGISTERED:
        _clear_last_error()  # else torch's next launch check reports it
        return False
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of the {size}-byte pool failed with CUDA error "
            f"{err}; check the memlock limit (ulimit -l) of the vLLM container"
        )
    return True


def _clear_last_error() -> None:
    path = _loaded_cudart()
    if path:
        ctypes.CDLL(path).cudaGetLastError()


def unregister_host(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _loaded_cudart() -> str | None:
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcudart.so" in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


def _from_cudart(path: str) -> Memcpy2D:
    fn = ctypes.CDLL(path).cudaMemcpy2DAsync
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    def copy(dst, dpitch, src, spitch, width, height, kind, stream):
        err = fn(dst, dpitch, src, spitch, width, height, kind, stream)
        if err:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")

    return copy


def _from_cudart_1d(path: str) -> Memcpy:
    fn = ctypes.CDLL(path).cudaMemcpyAsync
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                   ctypes.c_void_p]

    def copy(dst, src, nbytes, kind, stream):
        err = fn(dst, src, nbytes, kind, stream)
        if err:
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {err}")

    return copy


def _from_cupy() -> Memcpy2D | None:
    try:
        from cupy.cuda import runtime
    except ImportError:
        return None

    def copy(dst, dpitch, src, spitch, width, height, kind, stream):
        runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)

    return copy


def find_memcpy() -> Memcpy | None:
    """``cudaMemcpyAsync`` of the CUDA runtime in the process; None when it
    cannot be found (copy with ``Tensor.copy_`` then)."""
    torch.cuda.init()
    path = _loaded_cudart()
    if path:
        try:
            return _from_cudart_1d(path)
        except (OSError, AttributeError):
            pass
    return None


def find_memcpy2d() -> tuple[str, Memcpy2D | None]:
    """The strided copy to use and where it comes from: ``"cudart"``,
    ``"cupy"`` or ``"rows"`` (none: copy row by row)."""
    torch.cuda.init()
    path = _loaded_cudart()
    if path:
        try:
            return "cudart", _from_cudart(path)
        except (OSError, AttributeError):
            pass
    copy = _from_cupy()
    if copy is not None:
        return "cupy", copy
    return "rows", None
