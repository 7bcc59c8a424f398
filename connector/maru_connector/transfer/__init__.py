"""Moves KV bytes between the pool and vLLM's paged KV cache.

``create_engine`` picks the CPU backend (a copy thread per direction) or the
CUDA backend (registered pool, one load stream, staging + scatter) from the
KV cache's device (``TransferBackend``), importing only that backend; both
behave the same behind the ``TransferEngine`` interface.
"""

from .backend import HeadStart, Transfer, TransferBackend, TransferJob
from .checks import PayloadCheck
from .engine import TransferEngine
from .factory import create_engine
from .handles import ChecksumMismatch, LoadHandle, StoreHandle, TransferError
from .plan import ChunkLoad, ChunkStore, TransferRequestError

__all__ = [
    "ChecksumMismatch",
    "ChunkLoad",
    "ChunkStore",
    "HeadStart",
    "LoadHandle",
    "PayloadCheck",
    "StoreHandle",
    "Transfer",
    "TransferBackend",
    "TransferEngine",
    "TransferError",
    "TransferJob",
    "TransferRequestError",
    "create_engine",
]
