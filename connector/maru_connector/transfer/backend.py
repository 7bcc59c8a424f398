"""The transfer engine's seams: which backends exist, the job record a backend
works on, a load's head start, and the engine as the connector uses it.

``TransferEngine`` (``engine.py``) owns the queues and the copy threads and
calls its backend's hooks with a ``TransferJob``; a backend subclasses it
(``cpu.py``, ``cuda.py``). ``factory.py`` imports a backend by its
``TransferBackend`` kind only when an engine of that kind is built, so
neither the base nor the connector imports a backend module, and the CPU
path never loads the CUDA one.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from .checks import PayloadCheck
from .handles import LoadHandle, StoreHandle
from .plan import ChunkLoad, ChunkStore

if TYPE_CHECKING:
    import torch

    from ..object_format import ObjectFormat

__all__ = ["HeadStart", "LoadJob", "StoreJob", "Transfer", "TransferBackend", "TransferJob"]

Handle = TypeVar("Handle", LoadHandle, StoreHandle)


class TransferBackend(str, enum.Enum):
    """The backends, one per device kind the KV cache can live on."""

    CPU = "cpu"
    CUDA = "cuda"

    @classmethod
    def for_device(cls, device: str, on_cuda: bool) -> "TransferBackend":
        """The backend for ``device`` (``"auto"``: the KV cache's device, on a
        CUDA device when ``on_cuda``); a ValueError when ``device`` is no
        backend or not where the KV cache is."""
        if device == "auto":
            return cls.CUDA if on_cuda else cls.CPU
        try:
            kind = cls(device)
        except ValueError:
            names = " or ".join(repr(k.value) for k in cls)
            raise ValueError(f"device must be 'auto', {names}, not {device!r}") from None
        if (kind is cls.CUDA) != on_cuda:
            where = "a CUDA device" if on_cuda else "the CPU"
            raise ValueError(f"device={device!r} but the KV cache is on {where}")
        return kind

    @property
    def partial_chunk_loads(self) -> bool:
        """Whether the scheduler plans loads that begin inside a chunk
        (``plan.SKIP_BLOCK``: the whole object verified, only the blocks from
        there written) for this backend: a backend that says False gets no
        pool hit for a local hit that ends inside a chunk. Both engines load
        them: the CPU engine sums the skipped head where it lies in the pool;
        the CUDA engine stages and sums it with its object and leaves it out
        of the scatter (its ``-m cuda`` tests, ``test_partial_chunk_load.py``,
        passed on an H100: bench/RESULTS.md, "CUDA tests")."""
        return True

    @property
    def block_alias_loads(self) -> bool:
        """Whether the scheduler plans loads that end inside a chunk (the
        first blocks of a chunk a block alias names; trailing
        ``plan.SKIP_BLOCK``) for this backend, and stores prompt tails for
        them. Both engines load them as they load a skipped head (CPU: summed
        where they lie in the pool; CUDA: staged and summed, left out of the
        scatter; its ``-m cuda`` tests passed on an H100)."""
        return True


class HeadStart(abc.ABC):
    """The first fills of a load, copied before the load was submitted."""

    @abc.abstractmethod
    def claim(self, sources: list[tuple[int, ...]]) -> "HeadStart | None":
        """This head for the load of ``sources`` (None, and dropped, when it
        was started for other sources): from now on the load's to use."""

    @abc.abstractmethod
    def drop(self) -> None:
        """No load will use it (a no-op once claimed); idempotent."""


@dataclass(eq=False, slots=True)
class TransferJob(Generic[Handle]):
    """One submitted load or store, as the backend's hooks see it.

    The first fields are set at submit; the rest belong to a backend (None
    where it does not use them). Slotted: a backend that needs more state
    per job adds a field here, typed, rather than an attribute of its own.
    """

    handle: Handle
    block_ids: list[int]  # the chunks' block ids, concatenated
    offsets: list[tuple[int, ...]]  # per chunk, its objects' pool offsets
    beside_long_forward: bool = False  # a load the caller's forward overlaps (a partial hit)
    check: PayloadCheck | None = None  # a verified load's checksums
    head: HeadStart | None = None  # the load's head start, when it uses one (CUDA)
    # CUDA: the rest of a load whose first fills were issued on the submitting
    # thread, left for the copy thread; ``issue_failed`` when that issue failed.
    rest: Iterator[None] | None = None
    issue_failed: bool = False
    ready: torch.cuda.Event | None = None  # CUDA: recorded on the caller's stream at submit
    host_ids: torch.Tensor | None = None  # CUDA: pinned block ids kept alive until copied
    # CUDA: a verified load's device state (sums, expected, verify mask, flags, checks so far)
    check_state: list[torch.Tensor | int] | None = None


LoadJob = TransferJob[LoadHandle]
StoreJob = TransferJob[StoreHandle]


class Transfer(Protocol):
    """The transfer engine as the worker, loader and storer use it."""

    @property
    def fmt(self) -> ObjectFormat: ...

    @property
    def backend(self) -> TransferBackend: ...

    def start_head(self, sources: Sequence[tuple[int, ...]]) -> HeadStart | None: ...

    def submit_load(self, chunks: Sequence[ChunkLoad], beside_long_forward: bool = False,
                    head: HeadStart | None = None, check: PayloadCheck | None = None) -> LoadHandle: ...

    def submit_store(self, chunks: Sequence[ChunkStore]) -> StoreHandle: ...

    def close(self) -> None: ...
