"""vLLM's own scheduler driving both halves of the connector, over a toy model.

A real engine hides the steps; this harness shows them. ``SteppedEngine``
builds vLLM's ``Scheduler`` with MaruCache as its KV connector (the
scheduler half, created by vLLM itself), a worker-role connector on a real
CPU KV cache, and a toy forward pass that plays vLLM's CPU model runner: per
step it calls the worker connector in the model runner's order
(``handle_preemptions``, ``start_load_kv``, per layer ``wait_for_layer_load``
then the layer's compute, ``wait_for_save``, ``get_transfer_results``,
``get_block_ids_with_load_errors``, ``build_connector_worker_meta``) and hands
vLLM's scheduler the output, as ``EngineCore.step`` does. With
``defer_finalize`` it plays the order vLLM uses whenever a speculative
config is set (the runner's ``defer_kv_connector_finalize``, and from vLLM
0.33 the GPU runner's ``post_forward(defer_finalize=True)``): the step's
report (transfer results, load errors, worker metadata) is collected first,
and ``wait_for_save`` runs only after the drafter, i.e. after the report.

The toy model makes wrong KV visible. Every KV entry of layer ``l`` at
position ``p`` is an exact small integer computed from the *stored* entry of
position ``p - 1`` in the request's blocks, the entry of layer ``l - 1`` at
``p`` and the token: ``kv(l, p) = (3 kv(l, p-1) + 7 token + kv(l-1, p) + l + 1)
mod 8191``. Garbage in a block therefore spreads into every later position
and into the sampled token (``kv(last layer, last position) mod vocab``),
exactly as attention over unloaded KV would. :func:`expected_kv` gives the
right values from the tokens alone, so a test compares the blocks byte for
byte and the tokens one for one, with no tolerance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

MODULUS = 8191
VOCAB = 1000
LAYER_NAME = "model.layers.{}.self_attn.attn"


def expected_kv(tokens: list[int], num_layers: int) -> list[list[int]]:
    """``[layer][position]`` values the toy model computes for ``tokens``."""
    values = [[0] * len(tokens) for _ in range(num_layers)]
    for layer in range(num_layers):
        prev = 0
        for pos, token in enumerate(tokens):
            below = values[layer - 1][pos] if layer else 0
            prev = values[layer][pos] = (3 * prev + 7 * token + below + layer + 1) % MODULUS
    return values


def expected_next_token(tokens: list[int], num_layers: int) -> int:
    return expected_kv(tokens, num_layers)[-1][-1] % VOCAB


@dataclass
class StepRecord:
    """What one step did, for assertions."""

    scheduled: dict[str, int]
    invalid_block_ids: set[int]
    finished_recving: set[str]
    finished_sending: set[str]
    worker_meta: Any
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class ToyRequest:
    req_id: str
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)


class SteppedEngine:
    """vLLM's ``Scheduler`` + MaruCache's connector halves + the toy model.

    Args:
        model_dir: a model directory for vLLM's ``ModelConfig`` (its layer
            count is the toy model's).
        kv_transfer_config: the ``--kv-transfer-config`` dict.
        block_size, num_blocks, max_num_batched_tokens, max_num_seqs: vLLM's
            scheduler settings (small numbers make preemption easy).
        wrap_resources: optional hook ``f(resources) -> resources`` applied to
            the worker half's pool/engine/clients (fault injection).
        defer_finalize: call ``wait_for_save`` after the step's report, as
            vLLM does with a speculative config.
        scheduler_options: more ``SchedulerConfig`` fields (e.g. vLLM 0.34's
            ``max_num_inflight_kv_loads``).
        kv_events_config: vLLM's ``kv_events_config`` dict: the scheduler
            collects KV events (swap ``scheduler.kv_event_publisher`` to see them).
        prefix_caching: vLLM's own prefix cache (off by default here, so
            that every hit is the connector's).
    """

    def __init__(
        self,
        model_dir: str,
        kv_transfer_config: dict[str, Any],
        *,
        block_size: int = 16,
        num_blocks: int = 64,
        max_num_batched_tokens: int = 256,
        max_num_seqs: int = 8,
        num_kv_heads: int = 2,
        head_size: int = 8,
        wrap_resources: Callable[[Any], Any] | None = None,
        defer_finalize: bool = False,
        scheduler_options: dict[str, Any] | None = None,
        kv_events_config: dict[str, Any] | None = None,
        prefix_caching: bool = False,
    ) -> None:
        from vllm.config import ModelConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from maru_connector.connector import MaruKVConnector

        model = ModelConfig(model=model_dir, tokenizer=model_dir, dtype="float32", seed=0,
                            max_model_len=4096, skip_tokenizer_init=True)
        self.num_layers = model.get_num_layers(_parallel_config())
        self.block_size = block_size
        self.defer_finalize = defer_finalize
        with _runs_no_kernel():
            self.vllm_config = self._make_config(model, block_size, max_num_batched_tokens, max_num_seqs,
                                                 kv_transfer_config, scheduler_options, prefix_caching)
        if kv_events_config is not None:
            from vllm.config.kv_events import KVEventsConfig

            self.vllm_config.kv_events_config = KVEventsConfig(**kv_events_config)
        hashed = kv_events_config is not None or prefix_caching  # both name blocks by their hashes
        self._block_hasher = _block_hasher(block_size) if hashed else None
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        names = [LAYER_NAME.format(i) for i in range(self.num_layers)]
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                                 head_size=head_size, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size, log_stats=False,
        )
        # vLLM's CPU layout: one buffer, per layer (blocks, kv heads, block size, 2*head size).
        buffer = torch.zeros(self.num_layers, num_blocks, num_kv_heads, block_size, 2 * head_size)
        self.kv_caches = {name: buffer[i] for i, name in enumerate(names)}
        self.worker = MaruKVConnector(self.vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        if wrap_resources is not None:
            real_factory = self.worker.worker_half._resources_factory
            self.worker.worker_half._resources_factory = (
                lambda *args: wrap_resources(real_factory(*args)))
        self.worker.register_kv_caches(self.kv_caches)
        self.requests: dict[str, ToyRequest] = {}
        self.finished: dict[str, ToyRequest] = {}
        self.history: list[StepRecord] = []

    @staticmethod
    def _make_config(model: Any, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                     kv_transfer_config: dict[str, Any], scheduler_options: dict[str, Any] | None,
                     prefix_caching: bool = False) -> Any:
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig, VllmConfig

        return VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                max_model_len=4096, enable_chunked_prefill=True, is_encoder_decoder=False,
                **(scheduler_options or {})),
            kv_transfer_config=KVTransferConfig(**kv_transfer_config),
            device_config=DeviceConfig("cpu"),
        )

    # ---- requests -----------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(req_id, list(prompt), params, None, block_hasher=self._block_hasher)
        self.requests[req_id] = ToyRequest(req_id, list(prompt), max_tokens)
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.finished[req_id] = self.requests.pop(req_id)

    def status(self, req_id: str) -> str | None:
        request = self.scheduler.requests.get(req_id)
        return None if request is None else request.status.name

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    # ---- stepping -------------------------------------------------------------

    def step(self) -> StepRecord:
        """One ``EngineCore.step``: schedule, the toy forward, update from output."""
        output = self.scheduler.schedule()
        before = {r: self.scheduler.requests[r].num_computed_tokens - n
                  for r, n in output.num_scheduled_tokens.items()}
        blocks = {r: self.block_ids(r) for r in output.num_scheduled_tokens}
        runner_output, record = self._execute(output, before, blocks)
        for outputs in self.scheduler.update_from_output(output, runner_output).values():
            for out in outputs.outputs:  # the tokens vLLM accepted (a failed load's are dropped)
                if out.request_id in self.requests:
                    self.requests[out.request_id].output.extend(out.new_token_ids)
        for req_id in list(self.requests):
            request = self.scheduler.requests.get(req_id)
            if request is None or request.is_finished():
                self.finished[req_id] = self.requests.pop(req_id)
        self.history.append(record)
        return record

    def run(self, max_steps: int = 500, until: Callable[[], bool] | None = None) -> None:
        """Step until every request finished (or ``until()``), with a bound."""
        import time

        for _ in range(max_steps):
            if (until() if until is not None else not self.scheduler.has_requests()):
                return
            self.step()
            time.sleep(0.001)  # the loader and store threads run between steps
        raise TimeoutError(f"not done after {max_steps} steps; requests {list(self.requests)}")

    def _execute(self, output: Any, before: dict[str, int], blocks: dict[str, list[int]]):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        conn = self.worker
        meta = output.kv_connector_metadata
        conn.bind_connector_metadata(meta)
        conn.handle_preemptions(meta)
        if output.has_sync_kv_loads:
            conn.start_load_kv(None)
        # No forward when nothing is scheduled (vLLM's kv_connector_no_forward).
        for layer in range(self.num_layers if output.num_scheduled_tokens else 0):
            conn.wait_for_layer_load(LAYER_NAME.format(layer))
            for req_id, n in output.num_scheduled_tokens.items():
                self._compute(layer, self.scheduler.requests[req_id].all_token_ids,
                              before[req_id], n, blocks[req_id])
        if not output.has_sync_kv_loads:
            conn.start_load_kv(None)
        if not self.defer_finalize:
            conn.wait_for_save()
        results = conn.get_transfer_results(output.finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        worker_meta = conn.build_connector_worker_meta()
        if self.defer_finalize:  # the drafter runs here, then finalize_kv_connector
            conn.wait_for_save()
        conn.clear_connector_metadata()
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            end = before[req_id] + output.num_scheduled_tokens[req_id]
            if end < request.num_tokens:  # a chunk of a longer prefill: no token yet
                sampled.append([])
                continue
            sampled.append([int(self._entry(self.num_layers - 1, end - 1, blocks[req_id])) % VOCAB])
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving, invalid_block_ids=invalid,
            kv_connector_worker_meta=worker_meta,
        )
        fields = dict(req_ids=req_ids, sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                      pooler_output=[], kv_connector_output=kv_output)
        if "req_id_to_index" in _field_names(ModelRunnerOutput):  # vLLM before 0.34
            fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        runner_output = ModelRunnerOutput(**fields)
        record = StepRecord(dict(output.num_scheduled_tokens), set(invalid),
                            set(results.finished_recving or ()), set(results.finished_sending or ()),
                            worker_meta, set(results.failed_recving or ()))
        return runner_output, record

    def _slot(self, pos: int, blocks: list[int]) -> tuple[int, int]:
        return blocks[pos // self.block_size], pos % self.block_size

    def _entry(self, layer: int, pos: int, blocks: list[int]) -> float:
        block, offset = self._slot(pos, blocks)
        return float(self.kv_caches[LAYER_NAME.format(layer)][block, 0, offset, 0])

    def _compute(self, layer: int, tokens: list[int], start: int, n: int, blocks: list[int]) -> None:
        cache = self.kv_caches[LAYER_NAME.format(layer)]
        for pos in range(start, start + n):
            prev = self._entry(layer, pos - 1, blocks) if pos else 0.0
            below = self._entry(layer - 1, pos, blocks) if layer else 0.0
            value = (3 * int(prev) + 7 * tokens[pos] + int(below) + layer + 1) % MODULUS
            block, offset = self._slot(pos, blocks)
            cache[block, :, offset, :] = float(value)

    # ---- oracle ------------------------------------------------------------------

    def wrong_positions(self, req_id: str, tokens: list[int], upto: int | None = None) -> list[tuple[int, int]]:
        """(layer, position) entries of ``req_id``'s blocks that differ from
        :func:`expected_kv` of ``tokens`` (the first ``upto`` positions)."""
        upto = len(tokens) if upto is None else upto
        blocks = self.block_ids(req_id)
        want = expected_kv(tokens[:upto], self.num_layers)
        wrong = []
        for layer in range(self.num_layers):
            cache = self.kv_caches[LAYER_NAME.format(layer)]
            for pos in range(upto):
                block, offset = self._slot(pos, blocks)
                if not torch.all(cache[block, :, offset, :] == float(want[layer][pos])):
                    wrong.append((layer, pos))
        return wrong

    def close(self) -> None:
        self.worker.shutdown()
        connector = getattr(self.scheduler, "connector", None)
        if connector is not None:
            connector.shutdown()


def _block_hasher(block_size: int) -> Any:
    """The block hasher EngineCore gives every request (with a connector, or
    prefix caching): the block hashes vLLM's KV events name blocks by."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def _runs_no_kernel():
    """vLLM 0.34's CPU platform refuses a config on x86 without triton-cpu,
    which only its model kernels need; this harness runs none, so it lets
    the config through (a no-op where the check passes or does not exist)."""
    from unittest import mock

    try:
        import vllm.triton_utils as triton_utils
    except ImportError:
        return contextlib.nullcontext()
    if getattr(triton_utils, "HAS_TRITON", True):
        return contextlib.nullcontext()
    return mock.patch.object(triton_utils, "HAS_TRITON", True)


def _field_names(cls: type) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}


def _parallel_config():
    from vllm.config import ParallelConfig

    return ParallelConfig()
