"""The child side of `EngineProcess`: one vLLM engine serving a pipe.

Run as `python -m maru_tools.engine_server FD`; FD is one end of
a socket pair carrying pickled `(command, payload)` tuples. Every command
gets exactly one `("ok", result)` or `("error", text)` reply.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any, Callable


def _build_engine(spec: dict[str, Any]):
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec["model_dir"],
        tokenizer=spec["model_dir"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_num_seqs=spec["max_num_seqs"],
        block_size=spec["block_size"],
        enforce_eager=True,
        enable_prefix_caching=spec["enable_prefix_caching"],
        seed=0,
    )
    if spec["tensor_parallel_size"] > 1:
        kwargs.update(tensor_parallel_size=spec["tensor_parallel_size"], distributed_executor_backend="mp")
    if spec["num_gpu_blocks_override"] is not None:
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    if spec["kv_transfer_config"] is not None:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec["speculative_config"] is not None:
        kwargs["speculative_config"] = spec["speculative_config"]
    if spec.get("kv_events_config") is not None:
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    return LLM(**kwargs)


def _generate(llm, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Greedy decoding; TTFT is measured from submission to the first token."""
    prompts = payload["prompts"]
    if payload["concurrent"]:
        return _run_batch(llm, prompts, payload)
    results = []
    for prompt in prompts:
        results.extend(_run_batch(llm, [prompt], payload))
    return results


def _run_batch(llm, prompts: list[list[int]], payload: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    engine = llm.llm_engine
    transfer = payload.get("kv_transfer_params")
    params = SamplingParams(temperature=0.0, max_tokens=payload["max_tokens"], ignore_eos=True,
                            extra_args={"kv_transfer_params": transfer} if transfer else None)
    base = f"r{time.monotonic_ns()}-"
    submitted: dict[str, float] = {}
    first_token: dict[str, float] = {}
    prompt_kv: dict[str, bytes | None] = {}
    finished: dict[str, dict[str, Any]] = {}
    for i, prompt in enumerate(prompts):
        rid = f"{base}{i}"
        submitted[rid] = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    abort_at = None if payload.get("abort_after_s") is None else time.perf_counter() + payload["abort_after_s"]
    while len(finished) < len(prompts):
        if abort_at is not None and time.perf_counter() >= abort_at:
            pending = [rid for rid in submitted if rid not in finished]
            states = _request_states(llm, pending)
            engine.abort_request(pending)
            now = time.perf_counter()
            for rid in pending:
                n_prompt = len(prompts[int(rid.rsplit("-", 1)[1])])
                finished[rid] = _result(rid, [], submitted, first_token, now, n_prompt, True)
                finished[rid]["state_at_abort"] = states.get(rid)
            break
        # No sleep between steps, as in vLLM's own LLM.generate: a step whose
        # every request is parked waits for the connector's loader itself.
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            tokens = list(out.outputs[0].token_ids) if out.outputs else []
            if tokens and rid not in first_token:
                first_token[rid] = now
                if payload.get("dump_kv"):
                    prompt_kv[rid] = _prompt_kv(llm, rid, len(out.prompt_token_ids or []))
            if out.finished:
                finished[rid] = _result(rid, tokens, submitted, first_token, now, len(out.prompt_token_ids or []), False)
                finished[rid]["prompt_kv"] = prompt_kv.get(rid)
    return [finished[f"{base}{i}"] for i in range(len(prompts))]


def _prompt_kv(llm, request_id: str, num_tokens: int) -> bytes | None:
    """The KV the engine holds for a request's prompt, right after its prefill:
    every layer's rows of positions ``[0, num_tokens)``, gathered from its
    blocks (vLLM's CPU layout), as raw bytes. In-process engines only."""
    import torch

    scheduler = _scheduler(llm)
    if scheduler is None:
        raise RuntimeError("KV dumps need the engine in this process (multiprocessing off)")
    internal = next((r for r in scheduler.requests if r.rsplit("-", 1)[0] == request_id), None)
    if internal is None:
        return None  # already finished (max_tokens=1): its blocks may be reused
    block_ids = scheduler.kv_cache_manager.get_block_ids(internal)[0]
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    layers = []
    for cache in runner.kv_caches:  # (blocks, kv heads, block size, 2 * head size)
        rows = cache[list(block_ids)].transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])
        layers.append(rows[:num_tokens])
    return torch.stack(layers).contiguous().view(torch.uint8).numpy().tobytes()


def _result(rid, tokens, submitted, first_token, now, n_prompt, aborted) -> dict[str, Any]:
    start = submitted[rid]
    return {
        "token_ids": tokens,
        "ttft_s": first_token.get(rid, now) - start,
        "latency_s": now - start,
        "num_prompt_tokens": n_prompt,
        "aborted": aborted,
    }


def _scheduler(llm):
    """The scheduler, when EngineCore runs in this process (multiprocessing off)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return getattr(core, "scheduler", None)


def _request_states(llm, request_ids: list[str]) -> dict[str, str]:
    scheduler = _scheduler(llm)
    if scheduler is None:
        return {}
    states = {}
    wanted = set(request_ids)
    for rid, request in scheduler.requests.items():
        external = rid.rsplit("-", 1)[0]  # vLLM appends "-<8 random chars>"
        if external in wanted:
            states[external] = request.status.name
    return states


def _probe_preemptions(llm, payload: dict[str, Any]) -> int:
    """Preemptions since the first call (the first call installs the counter)."""
    scheduler = _scheduler(llm)
    if scheduler is None:
        raise RuntimeError("preemptions are counted only with multiprocessing off")
    if not hasattr(scheduler, "_maru_test_preemptions"):
        original = scheduler._preempt_request
        scheduler._maru_test_preemptions = 0

        def counting(*args, **kwargs):
            scheduler._maru_test_preemptions += 1
            return original(*args, **kwargs)

        scheduler._preempt_request = counting
    return scheduler._maru_test_preemptions


def _probe_object_counts(llm, payload: dict[str, Any]) -> dict[str, int]:
    """Live objects per type, for types defined in modules starting with `prefix`."""
    prefix = payload.get("prefix", "maru_")
    gc.collect()
    counts: Counter[str] = Counter()
    for obj in gc.get_objects():
        module = getattr(type(obj), "__module__", "") or ""
        if module.startswith(prefix):
            counts[f"{module}.{type(obj).__qualname__}"] += 1
    return dict(counts)


def _probe_trim_heap(llm, payload: dict[str, Any]) -> bool:
    """Hand glibc's freed arena memory back to the OS, so that resident memory read next is live memory."""
    import ctypes

    gc.collect()
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except OSError:  # not glibc: resident memory keeps the allocator's slack
        return False


def _probe_kv_cache_info(llm, payload: dict[str, Any]) -> dict[str, Any]:
    config = llm.llm_engine.vllm_config
    return {
        "block_size": config.cache_config.block_size,
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
    }


PROBES: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "object_counts": _probe_object_counts,
    "trim_heap": _probe_trim_heap,
    "kv_cache_info": _probe_kv_cache_info,
    "preemptions": _probe_preemptions,
}


def serve(conn: Connection) -> None:
    llm = None
    while True:
        try:
            command, payload = conn.recv()
        except EOFError:
            return
        try:
            if command == "shutdown":
                conn.send(("ok", None))
                return
            if command == "start":
                started = time.perf_counter()
                llm = _build_engine(payload)
                result: Any = {"start_s": time.perf_counter() - started}
            elif command == "generate":
                result = _generate(llm, payload)
            elif command == "probe":
                result = PROBES[payload["name"]](llm, payload)
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", result))
        except Exception:  # reported to the parent, which raises EngineError
            conn.send(("error", traceback.format_exc()))
            if command == "start":
                return


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
