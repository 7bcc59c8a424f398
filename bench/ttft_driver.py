"""One serving engine, stepped the way vLLM's scheduler and GPU model runner
step it, with the MaruCache connector's real scheduler half and worker half.

Per step: the scheduler half's lookup (``get_num_new_matched_tokens``), block
allocation and ``update_state_after_alloc`` for new requests,
``build_connector_meta``; then the worker half's ``handle_preemptions``,
the step's inputs (as vLLM's model runner prepares them after that call),
``start_load_kv``, the forward (``wait_for_layer_load`` before each layer's
attention; ``save_kv_layer`` is a no-op in this connector), ``wait_for_save``,
``get_finished``, ``get_block_ids_with_load_errors`` and
``build_worker_meta`` (the step's report), then the sampled tokens to the
host (vLLM computes the logits and samples once it has left its connector
context); and back on the scheduler side ``update_connector_output``, whose
verdict on the step's stores reaches the workers with the next step.
Parked (async) requests wait until ``get_finished`` reports them; a finished
request's blocks are freed at once or, when the connector asks (async
store), once its stores are reported.

Only prefill is modelled: a request is done when its last prompt token is
computed and its logits are on the host (its time to first token). Chunked
prefill splits prompts longer than ``max_batched_tokens`` over steps.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch

from llama_layer import Batch, EagerForward, LlamaStack, PiecewiseForward
from maru_connector.scheduler import MaruSchedulerHalf
from maru_connector.worker import MaruWorkerHalf

GRAPH_MAX_TOKENS = 512  # vLLM's default largest captured batch; larger ones run eagerly


@dataclass
class Request:
    """The fields of ``vllm.v1.request.Request`` the scheduler half reads."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    arrival: float = 0.0
    blocks: list[int] = field(default_factory=list)
    external: int = 0  # tokens the connector loads
    first_token_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class _Blocks:  # vLLM's KVCacheBlocks, one KV cache group
    def __init__(self, ids):
        self._ids = ids

    def get_block_ids(self):
        return (self._ids,)


class _BlockState:  # scheduler_output.kv_connector_block_state
    def __init__(self, table):
        self._table = table

    def get_block_ids(self, req_id):
        ids = self._table.get(req_id)
        return (ids,) if ids else None


class Engine:
    """An engine over one KV cache; ``scheduler``/``worker`` None: no connector."""

    def __init__(self, model: LlamaStack, kv_caches: dict, block_size: int,
                 scheduler: MaruSchedulerHalf | None, worker: MaruWorkerHalf | None,
                 graphs: bool = False, max_batched_tokens: int = 8192, seed: int = 0,
                 idle_step_s: float = 0.0001):
        self.model = model
        self.kv = kv_caches
        self.block_size = block_size
        self.scheduler = scheduler
        self.worker = worker
        self.graphs = graphs
        self.max_batched = max_batched_tokens
        self.idle_step_s = idle_step_s
        num_blocks = next(iter(kv_caches.values())).shape[0]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # vLLM's blocks are rarely contiguous
        self._eager = EagerForward(model, kv_caches)
        self._captured: dict[tuple, PiecewiseForward] = {}
        self.load_errors: set[int] = set()
        self.steps = 0
        self.keep_blocks = False  # finished requests keep their blocks (reference copies)
        self.stores_done_at: float | None = None

    # ---- blocks -----------------------------------------------------------
    def allocate(self, tokens: int) -> list[int]:
        need = -(-tokens // self.block_size)
        if need > len(self.free):
            raise RuntimeError(f"KV cache full: {need} blocks wanted, {len(self.free)} free")
        blocks, self.free = self.free[:need], self.free[need:]
        return blocks

    def release(self, blocks: list[int], force: bool = False) -> None:
        if force or not self.keep_blocks:
            self.free.extend(blocks)

    # ---- forward ----------------------------------------------------------
    def _forward(self, batch: Batch, wait: Callable[[str], None]) -> torch.Tensor:
        if not (self.graphs and len(batch.tokens) <= GRAPH_MAX_TOKENS):
            return self._eager(batch, wait)
        shape = (len(batch.tokens), len(batch.seqs))
        fwd = self._captured.get(shape)
        if fwd is None:
            fwd = self._captured[shape] = PiecewiseForward(self.model, self.kv, batch)
        return fwd(batch, wait)

    # ---- serving ----------------------------------------------------------
    def serve(self, requests: list[Request], compute: bool = True,
              timeout_s: float = 120.0) -> list[Request]:
        """Run steps until every request has its first token (with
        ``compute=False`` until its KV is loaded: the load alone)."""
        now = time.perf_counter()
        for r in requests:
            r.arrival = now
        waiting = list(requests)
        running: list[Request] = []
        parked: dict[str, Request] = {}
        finished_ids: set[str] = set()
        delayed: dict[str, list[int]] = {}
        deadline = now + timeout_s
        while waiting or running or parked:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"requests not served in {timeout_s}s")
            self._admit(waiting, running, parked, compute)
            finished_ids = self._step(running, parked, finished_ids, delayed, compute)
        self._drain_stores(finished_ids, delayed, deadline)
        return requests

    def _admit(self, waiting, running, parked, compute) -> None:
        for r in list(waiting):
            ext, is_async = 0, False
            if self.scheduler is not None:
                ext, is_async = self.scheduler.get_num_new_matched_tokens(r, 0)
                if ext is None:
                    continue  # lookup in flight: ask again next step
            r.blocks = self.allocate(r.num_tokens)
            r.external = ext
            if self.scheduler is not None:
                self.scheduler.update_state_after_alloc(r, _Blocks(r.blocks), ext)
            waiting.remove(r)
            if is_async:
                parked[r.request_id] = r
            else:
                r.num_computed_tokens = ext
                running.append(r)

    def _schedule(self, running) -> dict[str, int]:
        budget, out = self.max_batched, {}
        for r in running:
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if n > 0:
                out[r.request_id] = n
                budget -= n
        return out

    def _step(self, running, parked, finished_ids, delayed, compute) -> set[str]:
        self.steps += 1
        scheduled = self._schedule(running) if compute else {}
        meta = None
        if self.scheduler is not None:
            table = {r.request_id: r.blocks for r in running}
            out = SimpleNamespace(num_scheduled_tokens=scheduled, preempted_req_ids=set(),
                                  finished_req_ids=set(finished_ids),
                                  kv_connector_block_state=_BlockState(table))
            meta = self.scheduler.build_connector_meta(out)
        w = self.worker
        if w is not None:
            w.handle_preemptions(meta)
        by_id = {r.request_id: r for r in running}
        batch = self._prepare([(by_id[i], n) for i, n in scheduled.items()]) if scheduled else None
        if w is not None:
            w.start_load_kv(meta)
        logits = self._run_forward(batch) if batch is not None else None
        if batch is None:
            time.sleep(self.idle_step_s)  # an empty step of the engine loop
        sending, recving, worker_meta = set(), set(), None
        if w is not None:
            # vLLM's model runner leaves its connector context here, before
            # it computes the logits and samples: wait_for_save, then the
            # step's report.
            w.wait_for_save(meta)
            sending, recving, _ = w.get_finished(meta)
            self.load_errors |= w.get_block_ids_with_load_errors()
            worker_meta = w.build_worker_meta(meta)
        if logits is not None:
            self._sample(logits)
        done_now = set()
        if compute:
            for i, n in scheduled.items():
                r = by_id[i]
                r.num_computed_tokens += n
                if r.num_computed_tokens == r.num_tokens:
                    r.first_token_at = time.perf_counter()
                    done_now.add(i)
        else:
            for r in running:
                if r.first_token_at is None:
                    r.first_token_at = time.perf_counter()
                    done_now.add(r.request_id)
        if w is not None:
            self.scheduler.update_connector_output(SimpleNamespace(
                kv_connector_worker_meta=worker_meta, finished_recving=recving,
                finished_sending=sending))
        for i in recving:
            r = parked.pop(i, None)
            if r is not None:
                r.num_computed_tokens = r.external
                running.append(r)
                if not compute and r.first_token_at is None:
                    r.first_token_at = time.perf_counter()
                    done_now.add(i)
        for i in sending:
            self.release(delayed.pop(i, []))
        for i in done_now:
            r = by_id.get(i) or next(x for x in running if x.request_id == i)
            running.remove(r)
            self._finish(r, delayed)
        return done_now

    def _finish(self, r: Request, delayed) -> None:
        keep = False
        if self.scheduler is not None:
            keep, _ = self.scheduler.request_finished(r, r.blocks)
        if keep:
            delayed[r.request_id] = r.blocks
        else:
            self.release(r.blocks)

    def _prepare(self, work: list[tuple[Request, int]]) -> Batch:
        """The step's inputs: vLLM prepares them between ``handle_preemptions``
        and ``start_load_kv``."""
        return Batch.build(
            [(r.prompt_token_ids[r.num_computed_tokens:r.num_computed_tokens + n],
              r.num_computed_tokens, r.blocks) for r, n in work],
            self.block_size, self.model.device)

    def _run_forward(self, batch: Batch) -> torch.Tensor:
        """Queue the step's forward; its logits, not waited for."""
        wait = self.worker.wait_for_layer_load if self.worker is not None else _no_wait
        return self._forward(batch, wait)

    @staticmethod
    def _sample(logits: torch.Tensor) -> None:
        logits.argmax(-1).tolist()  # the sampled tokens reach the host: the step ends

    def _drain_stores(self, finished_ids, delayed, deadline) -> None:
        """Empty steps until every delayed block is released and the
        scheduler has sent every verdict on stores (vLLM steps while
        ``has_pending_push_work``): the stores are committed then."""
        while delayed or (self.scheduler is not None
                          and self.scheduler.has_pending_push_work()):
            if time.perf_counter() > deadline:
                raise TimeoutError("stores not finished")
            self._step([], {}, finished_ids, delayed, compute=True)
            finished_ids = set()
        self.stores_done_at = time.perf_counter()

    def time_suffix(self, r: Request, first: int, repeats: int = 3) -> float:
        """Seconds of the forward of ``r``'s tokens from ``first`` on, its
        earlier tokens' KV in place (compute alone; no connector)."""
        batch = Batch.build([(r.prompt_token_ids[first:], first, r.blocks)], self.block_size,
                            self.model.device)
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize() if batch.tokens.is_cuda else None
            t = time.perf_counter()
            self._forward(batch, _no_wait).argmax(-1).tolist()
            times.append(time.perf_counter() - t)
        return sorted(times[1:])[len(times[1:]) // 2]


def _no_wait(name: str) -> None:
    return None
