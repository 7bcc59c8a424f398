"""Timestamps of one hit's phases, for ``bench/ttft_async.py --trace``.

Put this directory first on ``PYTHONPATH`` and set ``MARU_TRACE_FILE``: every
process of the engine (caller, EngineCore, worker) then appends one JSON line
per phase event to that file: ``[monotonic_s, pid, thread, event, detail]``.
``time.monotonic`` is one clock for all processes of the machine. The
connector's code is wrapped here, from outside, so it carries no tracing.
"""

from __future__ import annotations

import os

_PATH = os.environ.get("MARU_TRACE_FILE")


def _install() -> None:
    import builtins
    import functools
    import json
    import threading
    import time

    fh = open(_PATH, "a", buffering=1, encoding="utf-8")
    lock = threading.Lock()

    def emit(event: str, detail=None) -> None:
        line = json.dumps([time.monotonic(), os.getpid(), threading.current_thread().name, event, detail])
        with lock:
            fh.write(line + "\n")

    def wrap(owner, name, describe=None, after=True):
        original = getattr(owner, name)

        @functools.wraps(original)
        def traced(*args, **kwargs):
            emit(f"{name}>", describe(*args, **kwargs) if describe else None)
            result = original(*args, **kwargs)
            if after:
                emit(f"{name}<", None)
            return result

        setattr(owner, name, traced)

    done: set[str] = set()

    def patch(module_name: str) -> None:
        if module_name in done:
            return
        done.add(module_name)
        if module_name == "maru_connector.scheduler":
            from maru_connector import scheduler as m
            cls = m.MaruSchedulerHalf
            wrap(cls, "get_num_new_matched_tokens", lambda s, r, n: r.request_id)
            wrap(cls, "update_state_after_alloc", lambda s, r, b, n: [r.request_id, n, r.num_tokens],
                 after=False)
            wrap(cls, "build_connector_meta",
                 lambda s, o: [o.total_num_scheduled_tokens, len(s._pending_loads)], after=False)
            wrap(cls, "update_connector_output",
                 lambda s, o: sorted(o.finished_recving or ()), after=False)
        elif module_name == "maru_connector.worker":
            from maru_connector import worker as m
            cls = m.MaruWorkerHalf
            wrap(cls, "start_load_kv", lambda s, meta: [len(meta.loads), len(meta.scheduled_req_ids)])
            wrap(cls, "wait_for_layer_load", lambda s, name, *computing: name)
            wrap(cls, "wait_for_save", lambda s, meta: len(meta.stores))
            wrap(cls, "get_finished", lambda s, meta: None)
            wrap(m, "resolve_load", lambda *a, **k: "sync")
        elif module_name == "maru_connector.loader":
            from maru_connector import loader as m
            wrap(m, "resolve_load", lambda *a, **k: None)
            wrap(m.AsyncLoader, "_release", lambda s, ld: ld.spec.req_id, after=False)
            wrap(m.AsyncLoader, "_finish", lambda s, ld: ld.spec.req_id, after=False)
            wrap(m.AsyncLoader, "submit", lambda s, spec, *early: spec.req_id, after=False)
        elif module_name == "maru_connector.transfer.handles":
            from maru_connector.transfer import handles as m
            wrap(m.LoadHandle, "_mark_layer", lambda s, layer, *a: layer, after=False)
        elif module_name == "maru_connector.transfer.cpu":
            from maru_connector.transfer import cpu as m
            wrap(m.CpuTransferEngine, "_run_load", lambda s, job: len(job.block_ids))
            wrap(m.CpuTransferEngine, "_run_store", lambda s, job: len(job.block_ids))
        elif module_name == "vllm.v1.worker.cpu_worker":
            import torch
            from vllm.v1.worker import cpu_worker as m
            wrap(m.CPUWorker, "execute_model",
                 lambda s, out, *a, **k: [out.total_num_scheduled_tokens, torch.get_num_threads()])
        elif module_name == "vllm.v1.engine.llm_engine":
            from vllm.v1.engine import llm_engine as m
            wrap(m.LLMEngine, "add_request", lambda s, rid, *a, **k: rid, after=False)
            original = m.LLMEngine.step

            def step(self, *args, **kwargs):
                outputs = original(self, *args, **kwargs)
                for out in outputs:
                    if out.outputs and out.outputs[0].token_ids:
                        emit("token", out.request_id)
                return outputs

            m.LLMEngine.step = step

    targets = ("maru_connector.scheduler", "maru_connector.worker", "maru_connector.loader",
               "maru_connector.transfer.handles", "maru_connector.transfer.cpu",
               "vllm.v1.worker.cpu_worker", "vllm.v1.engine.llm_engine")
    import sys

    real_import = builtins.__import__

    def importing(name, *args, **kwargs):
        module = real_import(name, *args, **kwargs)
        for target in targets:
            if target not in done and target in sys.modules:
                try:
                    patch(target)
                except Exception:  # a half-imported module: try on the next import
                    done.discard(target)
        return module

    builtins.__import__ = importing


if _PATH:
    _install()
