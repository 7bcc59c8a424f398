"""Where a hit's time goes, from host timestamps: no profiler, so the hit
runs at its real speed (a torch-profiler trace of a 16 ms hit takes 34 ms).

``PhaseRecorder`` wraps the connector calls of one ``ttft_driver.Engine``
(the scheduler half's lookup, the worker half's ``start_load_kv``,
``wait_for_layer_load``, ``wait_for_save``, ``get_finished``, the
transfer engine's ``submit_load``) and the engine's forward, and reports per
hit, in ms from arrival: when the lookup answered, when the load was
submitted, when its copies began to be queued and when all were, when its
first and last layers landed on the device (engines built with
``timing=True``), when the forward started and when all of it was queued,
how long the forward waited for layers, how long the ``wait_for_save`` after
it took, and the first token. The driver, like vLLM, calls
``wait_for_save`` before the sampled tokens reach the host, so that wait is
part of the first token (reports before this order named the forward's end,
with the token on the host, ``forward_ended``).
"""

from __future__ import annotations

import statistics
import threading
import time

WRAPPED = {
    "scheduler": ("get_num_new_matched_tokens", "build_connector_meta"),
    "worker": ("start_load_kv", "wait_for_layer_load", "wait_for_save", "get_finished"),
    "engine": ("_run_forward",),
}


class PhaseRecorder:
    def __init__(self, eng) -> None:
        self.spans: list[tuple[str, float, float]] = []
        self.handles: list[tuple[float, object]] = []
        self._lock = threading.Lock()
        self._wrapped: list[tuple[object, str]] = []
        targets = {"scheduler": eng.scheduler, "worker": eng.worker, "engine": eng}
        for role, names in WRAPPED.items():
            for name in names:
                self._wrap(targets[role], name)
        self._wrap(eng.worker._require_resources().engine, "submit_load", keep=True)

    def _wrap(self, obj, name: str, keep: bool = False) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            end = time.perf_counter()
            with self._lock:
                self.spans.append((name, start, end))
                if keep:
                    self.handles.append((start, out))
            return out

        setattr(obj, name, timed)  # an instance attribute: shadows the method
        self._wrapped.append((obj, name))

    def close(self) -> None:
        for obj, name in self._wrapped:
            delattr(obj, name)

    def reset(self) -> None:
        with self._lock:
            self.spans.clear()
            self.handles.clear()

    def phases(self, arrival: float, first_token: float) -> dict[str, float]:
        """One hit's phases, ms from ``arrival`` (all recorded since reset)."""
        ms = lambda t: (t - arrival) * 1000  # noqa: E731
        by = {}
        for name, start, end in self.spans:
            by.setdefault(name, []).append((start, end))
        out: dict[str, float] = {}
        if "get_num_new_matched_tokens" in by:
            out["lookup_answered"] = ms(max(e for _, e in by["get_num_new_matched_tokens"]))
        if self.handles:
            submitted, handle = self.handles[0]
            out["load_submitted"] = ms(submitted)
            times = handle.device_layer_times_s() if hasattr(handle, "device_layer_times_s") \
                else None
            for name in ("issue_started_at", "issued_at"):  # queueing its copies
                at = getattr(handle, name, None)
                if at is not None:
                    out["copies_" + name[:-3]] = ms(submitted + at - handle.submitted_at)
            if times:
                out["first_layer_landed"] = ms(submitted + times[0])
                for k in (len(times) // 4, len(times) // 2, 3 * len(times) // 4):
                    out[f"layer_{k}_landed"] = ms(submitted + times[k])  # where a load falls behind
                out["last_layer_landed"] = ms(submitted + times[-1])
        loads = [s for s in by.get("start_load_kv", []) if s[1] - s[0] > 0]
        if loads:
            out["start_load_kv_ms"] = sum(e - s for s, e in loads) * 1000
        fwd = by.get("_run_forward", [])
        if fwd:
            out["forward_started"] = ms(fwd[-1][0])
            out["forward_queued"] = ms(fwd[-1][1])
        waits = by.get("wait_for_layer_load", [])
        if waits:
            out["layer_waits_ms"] = sum(e - s for s, e in waits) * 1000
        out["first_token"] = ms(first_token)
        saves = [s for s in by.get("wait_for_save", []) if fwd and s[0] >= fwd[-1][1]]
        if saves:
            out["wait_for_save_ms"] = (saves[0][1] - saves[0][0]) * 1000
        return out


def median_phases(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in rows[0] if all(k in r for r in rows)] if rows else []
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def describe(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
