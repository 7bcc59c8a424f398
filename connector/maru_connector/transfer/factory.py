"""Builds the transfer engine of a worker: picks the backend for the KV
cache's device and imports its module only then (the CPU path never loads
the CUDA backend; the engine base imports no backend)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..object_format import ObjectFormat
from .backend import TransferBackend
from .engine import TransferEngine

__all__ = ["BACKEND_CLASSES", "backend_class", "create_engine"]

#: Where each backend's engine class lives: (module, class name).
BACKEND_CLASSES: dict[TransferBackend, tuple[str, str]] = {
    TransferBackend.CPU: (f"{__package__}.cpu", "CpuTransferEngine"),
    TransferBackend.CUDA: (f"{__package__}.cuda", "CudaTransferEngine"),
}


def backend_class(kind: TransferBackend) -> type[TransferEngine]:
    """The engine class of backend ``kind``, its module imported now."""
    module_name, class_name = BACKEND_CLASSES[kind]
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(engine_cls, type) and issubclass(engine_cls, TransferEngine)):
        raise TypeError(f"{module_name}.{class_name} is not a TransferEngine")
    return engine_cls


def create_engine(pool_buffer: memoryview, kv_caches: dict[str, torch.Tensor],
                  fmt: ObjectFormat, device: str = "auto", prefault: bool = True,
                  copy_cpus: frozenset[int] | None = None, copy_priority: str = "idle",
                  **options: Any) -> TransferEngine:
    """Build and start the engine for the device the KV cache lives on.

    Args:
        pool_buffer: a writable memoryview of the whole pool mapping.
        kv_caches: the tensors vLLM handed to ``register_kv_caches``.
        fmt: the object format; its layout must match ``kv_caches``.
        device: ``"auto"`` (the KV cache's device), ``"cpu"`` or ``"cuda"``.
        prefault: CPU: map the pool's pages in the background at start
            (``prefault.py``); CUDA registers the pool, which maps them.
        copy_cpus: CPU: the cores for the copy threads, None: unpinned
            (``copy_cpus.py``); CUDA's copies run on its copy engines.
        copy_priority: CPU: ``"idle"`` (the load thread runs only where
            a core is otherwise idle) or ``"normal"``.
        options: backend options (CUDA: ``staging_bytes``, ...), passed to
            the backend's constructor.
    """
    on_cuda = any(t.is_cuda for t in kv_caches.values())
    kind = TransferBackend.for_device(device, on_cuda)
    if kind is TransferBackend.CPU:
        options.update(prefault=prefault, copy_cpus=copy_cpus, copy_priority=copy_priority)
    engine = backend_class(kind)(pool_buffer, kv_caches, fmt, **options)
    engine._start()
    return engine
