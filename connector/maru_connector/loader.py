"""The async loader: parked requests are resolved, copied and released here.

One thread per worker. For each parked request it does the batched
``retrieve`` (pins), checks the reply and the slot headers, then queues the
copies on the transfer engine's one shared load queue and releases the
request once enough layers have landed:

- overlap off: after every layer landed (and the pins are released);
- overlap on: after ``maru_overlap_release_after_layers`` layers landed (0:
  as soon as the copies are queued); the resumed forward then waits per
  layer in :meth:`AsyncLoader.wait_layer`.

A failure before release fails the request while it is still parked (its
blocks are reported as load errors in the same step as its release). After
release only copies from pinned slots remain; pins are released once every
copy has completed. A copy that still fails after release is reported in the
step whose forward computes the request (the forward's layer wait sees it
first, or :meth:`AsyncLoader.take_results` hands it over when that request is
scheduled). No exception ends the loader thread: it fails the load it came
from and serves the others. The loader keeps state only for loads in flight
and failures not yet reported.

Nothing here polls on the CPU: the loader thread sleeps until a load is
submitted, drained or one of its copies completes a layer (the handle's
listener wakes it), and the engine thread, when its step computed nothing
(every request parked), sleeps in :meth:`AsyncLoader.wait_for_results` until
a load is released or failed instead of stepping again at once. Sleeping on
an event leaves the GIL and the cores to the loader and the copies. CUDA
handles complete a layer on the device, so there the loader still checks
them every ``_DEVICE_POLL_S``.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from maru_core.stats import ConnectorStats

from maru_connector.log import get_logger
from maru_connector.metadata import LoadSpec
from maru_connector.resolve import LoadFailure, PinnedLoad, copy_failure_reason, release_pins, resolve_load
from maru_connector.transfer.backend import Transfer, TransferBackend

if TYPE_CHECKING:
    from maru_core.index.client import IndexClient
    from maru_core.pool import Pool

    from maru_connector.early_pins import EarlyPin
    from maru_connector.transfer.handles import LoadHandle

_T = TypeVar("_T")

logger = get_logger(__name__)

_POLL_S = 0.002  # how often a failed handle's stopped copies are checked
_DEVICE_POLL_S = 0.002  # device copies complete without waking anyone
# A safety net only: on the CPU every completion wakes the loader thread.
_HOST_WAKE_S = 0.05


class _Waitable(Protocol):
    """What ``wait_done`` needs of a load handle."""

    def wait_all(self, timeout: float | None = None) -> bool: ...

    def done(self) -> bool: ...


def wait_done(handle: _Waitable) -> None:
    """Block until a transfer handle finished, successfully or not."""
    handle.wait_all()
    while not handle.done():  # a failed copy: its events are set as it stops
        time.sleep(_POLL_S)


@dataclass
class _Load:
    spec: LoadSpec
    started: float
    early: EarlyPin | None = None  # the lookup's pin for this load, now the loader's
    pinned: PinnedLoad | None = None
    handle: LoadHandle | None = None
    released: bool = False
    aborted: bool = False
    late_failure_recorded: bool = False  # failed after release, waiting to be reported
    wakes_loader: bool = False  # its handle wakes the loader thread whenever it moves
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def copies(self) -> LoadHandle:
        """The handle of its copies: every load submitted to the engine has one."""
        if self.handle is None:
            raise RuntimeError(f"the load of {self.spec.req_id} has no copies yet")
        return self.handle

    @property
    def pins(self) -> PinnedLoad:
        """What it pinned: every load past its resolve has it."""
        if self.pinned is None:
            raise RuntimeError(f"the load of {self.spec.req_id} pinned nothing yet")
        return self.pinned


@dataclass
class LoadResults:
    """What the loader finished since the last call: released ids, failures
    before release, and failures after release of requests now scheduled."""

    released: set[str] = field(default_factory=set)
    failed: dict[str, list[int]] = field(default_factory=dict)
    failed_after_release: dict[str, list[int]] = field(default_factory=dict)


class AsyncLoader:
    """Resolves and copies parked requests' KV on its own thread.

    Args:
        client_factory: builds this thread's index client (its own lease).
        pool: the attached pool (slot headers are read from it).
        engine: the worker's transfer engine.
        tp_rank: picks this rank's keys from each :class:`LoadSpec`.
        release_after_layers: layers that must land before release (the
            number of layers when overlap is off).
        stats: where loads, load failures and their durations are counted.
        verify_payload: check each object's payload checksum before copying.
    """

    def __init__(
        self,
        client_factory: Callable[[], IndexClient],
        pool: Pool,
        engine: Transfer,
        tp_rank: int,
        release_after_layers: int,
        stats: ConnectorStats,
        verify_payload: bool = False,
    ) -> None:
        self._client_factory = client_factory
        self._client: IndexClient | None = None
        self._pool = pool
        self._engine = engine
        self._fmt = engine.fmt
        self._tp_rank = tp_rank
        self._num_layers = engine.fmt.layout.num_layers
        self._release_after = min(release_after_layers, self._num_layers)
        self._stats = stats
        self._verify_payload = verify_payload
        self._inbox: queue.Queue[_Load | None] = queue.Queue()
        self._wake = threading.Event()  # the loader thread has something to look at
        self._host_copies = engine.backend == TransferBackend.CPU  # a landed layer is ready
        self._results_ready = threading.Event()  # set while _results holds something
        self._lock = threading.Lock()
        self._loads: dict[str, _Load] = {}  # in flight: queued, copying or released
        self._results = LoadResults()
        # Released loads that failed, until the request is scheduled (or gone).
        self._late_failures: dict[str, list[int]] = {}
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="maru-loader", daemon=True)
        self._thread.start()

    # ---- engine thread ----------------------------------------------------

    def submit(self, spec: LoadSpec, early: EarlyPin | None = None) -> None:
        """Queue a parked request's load; ``early``: its early pin (now ours)."""
        load = _Load(spec, time.monotonic(), early)
        with self._lock:
            self._loads[spec.req_id] = load
        self._inbox.put(load)
        self._wake.set()

    def wait_for_results(self, timeout: float) -> bool:
        """Sleep until a load not yet released is released or fails, or
        ``timeout`` seconds passed; returns at once when no such load is in
        flight or results are waiting. True when results are waiting.

        The engine thread calls this in a step that computed nothing, so that
        an engine whose every request is parked waits for the loader instead
        of stepping (and holding the GIL) again at once.
        """
        with self._lock:
            pending = any(not ld.released for ld in self._loads.values())
        if pending and self._dead is None:
            self._results_ready.wait(timeout)
        return self._results_ready.is_set()

    def take_results(self, scheduled_req_ids: Iterable[str] = ()) -> LoadResults:
        """Released and failed requests since the last call, atomically, and
        the failures after release of requests that vLLM can still roll back:
        those this step computed (``scheduled_req_ids``) and those whose
        release is reported now (vLLM sees them still parked).

        Raises:
            RuntimeError: the loader thread died; parked requests could never
                be released, so the engine must stop rather than hang.
        """
        self._check_alive()
        with self._lock:
            results, self._results = self._results, LoadResults()
            self._results_ready.clear()
            reportable = set(scheduled_req_ids) | results.released
            for req_id in reportable & self._late_failures.keys():
                results.failed_after_release[req_id] = self._late_failures.pop(req_id)
        return results

    def wait_layer(self, position: int, req_ids: Collection[str] | None = None) -> float:
        """Block until layer ``position`` of the released loads of ``req_ids``
        (the requests the forward computes; None: every released load)
        landed, or failed: recorded for :meth:`take_results`. The seconds
        waited.

        Loads of other requests are not waited for: this forward does not
        read their blocks, so it never waits behind another request's load.
        """
        with self._lock:
            loads = [ld for ld in self._loads.values()
                     if ld.released and (req_ids is None or ld.spec.req_id in req_ids)]
        if not loads:
            return 0.0
        start = time.perf_counter()
        failed = []
        for load in loads:
            # CUDA: the forward's stream waits on the copy event, not the host.
            if not load.copies.wait_layer_on_device(position):
                failed.append(load)
        waited = time.perf_counter() - start
        for load in failed:  # counted once, whoever sees it first
            self._late_failure(load, copy_failure_reason(load.copies.error))
        return waited

    def drain(self, req_ids: Iterable[str]) -> None:
        """Before vLLM reuses these requests' blocks: abort and finish their copies.

        A load not yet released is only marked aborted (vLLM keeps a parked
        request's blocks until the loader reports it); a released load still
        copying is waited for, because vLLM may already have freed its blocks.
        """
        waits = []
        with self._lock:
            for req_id in req_ids:
                self._late_failures.pop(req_id, None)  # its blocks are being freed
                load = self._loads.get(req_id)
                if load is None:
                    continue
                load.aborted = True
                if load.released:
                    waits.append(load.done)
        self._wake.set()
        for event in waits:
            while not event.wait(0.1):
                self._check_alive()

    def wait_idle(self, poll_s: float = 0.01) -> None:
        """Block until no load is in flight: every one submitted so far has
        been released and its copies finished, or has failed. Their outcomes
        stay queued for :meth:`take_results`. Sleep mode calls this before
        vLLM releases the KV cache the copies write into."""
        while self.num_in_flight:
            self._check_alive()
            time.sleep(poll_s)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise RuntimeError("the MaruCache loader thread died; see the log") from self._dead

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._loads)

    def close(self) -> None:
        self._inbox.put(None)
        self._wake.set()
        self._thread.join(timeout=30)
        if self._client is not None:
            self._client.close()

    # ---- loader thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug outside any one load: stop the engine loudly
            logger.critical("the MaruCache loader thread died", exc_info=True)
            self._dead = exc
            self._results_ready.set()  # the engine thread must not sleep on a dead loader

    def _serve(self) -> None:
        active: list[_Load] = []
        stopping = False
        while not stopping:
            self._wake.clear()  # anything from now on wakes the wait below
            while True:  # start every queued load before looking at copies
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                self._guarded(item, functools.partial(self._start, item, active))
            active = [ld for ld in active if self._guarded(ld, functools.partial(self._still_active, ld))]
            if not stopping:
                self._wake.wait(self._wake_after(active))
        for load in active:  # shutting down: copies from pinned slots still finish
            wait_done(load.copies)
            self._finish(load)

    @staticmethod
    def _wake_after(active: list[_Load]) -> float | None:
        """How long the loader thread may sleep: until woken when every
        active load wakes it, else until the next check of the others."""
        if not active:
            return None
        return _HOST_WAKE_S if all(ld.wakes_loader for ld in active) else _DEVICE_POLL_S

    def _guarded(self, load: _Load, step: Callable[[], _T]) -> _T | bool:
        """Run one step of one load; an exception fails that load only
        (recompute), and the thread goes on serving the others. Returns the
        step's result, or False once the load has been failed."""
        try:
            return step()
        except Exception as exc:
            logger.exception("KV load for %s failed in the loader", load.spec.req_id)
            if load.released:  # its copies may still run: keep the pins to the lease
                self._late_failure(load, "copy_error")
                with self._lock:
                    self._loads.pop(load.spec.req_id, None)
                load.done.set()
            else:
                self._fail(load, "copy_error", f"{type(exc).__name__}: {exc}")
            return False

    def _start(self, load: _Load, active: list[_Load]) -> None:
        spec = load.spec
        if load.aborted:
            if load.early is not None:
                load.early.release()
            self._stats.record_load_failure("aborted")
            self._report(load, failed=False)
            return
        try:
            if self._client is None:
                self._client = self._client_factory()
            load.pinned = resolve_load(
                self._client, self._pool, self._fmt, spec.keys(self._tp_rank), spec.block_ids,
                verify_payload=self._verify_payload, early=load.early,
            )
        except LoadFailure as exc:
            self._fail(load, exc.reason, str(exc))
            return
        except Exception as exc:  # e.g. the client could not connect
            if load.early is not None:
                load.early.release()
            self._fail(load, "index_error", f"{type(exc).__name__}: {exc}")
            return
        if load.pinned.early is not None:
            self._stats.record_early_pinned_load()
        try:
            load.handle = self._engine.submit_load(load.pinned.chunks, head=load.pinned.head,
                                                   check=load.pinned.check)
        except Exception:
            release_pins(self._client, load.pinned)  # nothing was queued
            raise
        if getattr(load.handle, "head_start", False):
            self._stats.record_head_start_load()
        set_listener = getattr(load.handle, "set_listener", None)
        if set_listener is not None:  # else found by the periodic check
            set_listener(self._wake.set)
            load.wakes_loader = self._host_copies
        active.append(load)

    def _still_active(self, load: _Load) -> bool:
        """``_advance``, True while ``load`` is not done."""
        return not self._advance(load)

    def _advance(self, load: _Load) -> bool:
        """Release and finish ``load`` as far as its copies allow; True when done."""
        handle = load.copies
        if not load.released:
            if handle.error is not None:
                if not handle.done():
                    return False
                release_pins(self._client, load.pins)
                self._fail(load, copy_failure_reason(handle.error), repr(handle.error))
                return True
            need = self._num_layers if load.aborted else self._release_after
            if not all(handle.layer_ready(i) for i in range(need)):
                return False
            self._release(load)
        if not handle.done():
            return False
        if handle.error is not None:
            self._late_failure(load, copy_failure_reason(handle.error))
        self._finish(load)
        return True

    def _late_failure(self, load: _Load, reason: str) -> None:
        """A released load failed: vLLM hears of it when the request is scheduled."""
        if self._record_late_failure(load):
            logger.error("KV copy for %s failed after release: %r", load.spec.req_id,
                         load.handle.error if load.handle is not None else None)
            self._stats.record_load_failure(reason)

    def _record_late_failure(self, load: _Load) -> bool:
        """Record once that ``load`` failed after release; True the first time."""
        with self._lock:
            if load.late_failure_recorded:
                return False
            load.late_failure_recorded = True
            if not load.aborted:
                self._late_failures[load.spec.req_id] = load.spec.all_block_ids()
            return True

    def _release(self, load: _Load) -> None:
        with self._lock:
            load.released = True
            self._results.released.add(load.spec.req_id)
            self._results_ready.set()

    def _finish(self, load: _Load) -> None:
        release_pins(self._client, load.pins)
        self._stats.record_load(load.copies.nbytes, time.monotonic() - load.started)
        logger.debug("hit %s: %d tokens, %d bytes loaded (park)", load.spec.req_id,
                     len(load.spec.all_block_ids()) * self._fmt.layout.block_size, load.copies.nbytes)
        with self._lock:
            self._loads.pop(load.spec.req_id, None)
        load.done.set()

    def _fail(self, load: _Load, reason: str, detail: str) -> None:
        logger.warning("KV load for %s failed (%s); vLLM recomputes it", load.spec.req_id, detail)
        self._stats.record_load_failure(reason)
        self._report(load, failed=True)

    def _report(self, load: _Load, failed: bool) -> None:
        with self._lock:
            if failed:
                self._results.failed[load.spec.req_id] = load.spec.all_block_ids()
            else:
                self._results.released.add(load.spec.req_id)
            self._results_ready.set()
            self._loads.pop(load.spec.req_id, None)
        load.done.set()
