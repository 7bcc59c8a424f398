"""Moves KV bytes between the pool and vLLM's paged KV cache.

``TransferEngine.create`` picks the CPU backend (a copy thread per direction)
or the CUDA backend (registered pool, one load stream, staging + scatter) from
the KV cache's device; both behave the same behind this interface.
"""

from .engine import TransferEngine
from .checks import PayloadCheck
from .handles import ChecksumMismatch, LoadHandle, StoreHandle, TransferError
from .plan import ChunkLoad, ChunkStore, TransferRequestError

__all__ = [
    "ChecksumMismatch",
    "ChunkLoad",
    "ChunkStore",
    "LoadHandle",
    "PayloadCheck",
    "StoreHandle",
    "TransferEngine",
    "TransferError",
    "TransferRequestError",
]
