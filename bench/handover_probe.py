"""Where a partial hit's load waits between the engine thread and the copy
thread (bench/RESULTS.md, round 13: "A lead for the partial hit").

    PYTHONPATH=connector:core:tools:tests/connector python3 bench/handover_probe.py \
        --probe-out DIR [--gil-probe] -- [bench/ttft_gpu.py arguments]

Runs ``bench/ttft_gpu.py`` with host timestamps (``perf_counter_ns``, no
profiler) on the steps of each load's hand-over: the submitting thread
issues a partial hit's head and releases the issue lock; the copy thread,
which took the job from the queue already, acquires the lock and queues
the next fill's copies. Also logged: the forward's waits for each layer,
each layer's mark, every garbage collection (which thread, how long) and,
with ``--gil-probe``, when a thread that sleeps 50 us at a time wakes more
than 200 us late (the interpreter lock held elsewhere; the probe thread is
one more contender, so timings shift).

``hit_phases.py`` times the connector's calls per hit; this probe times
the transfer engine's own steps inside them.

Two knobs join the CUDA engine's for ``--paired --arms``: ``PROBE_SWITCH_US``
(the interpreter's switch interval during a hit, 5000 as CPython ships) and
``PROBE_GC`` (0: garbage collection off during a hit).

Writes ``handover.json`` (each load's steps, in ms from its submit) and
prints, per kind of load and arm (the knobs it sets), each step's median.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]

import ttft_gpu  # noqa: E402  (installs the vLLM shim)
import maru_connector.transfer.cuda as cuda_engine  # noqa: E402
from maru_connector.transfer.handles import LoadHandle  # noqa: E402

EVENTS: list[tuple] = []  # (ns, thread ident, what, load id or None, detail)
_current = threading.local()  # the load a thread is issuing
_ids = itertools.count()


def load_id(handle: LoadHandle) -> int:
    """A number for the load, kept on its handle (``id()`` is reused)."""
    number = getattr(handle, "_probe_id", None)
    if number is None:
        number = handle._probe_id = next(_ids)
    return number


def log(what: str, load=None, detail=None) -> None:
    EVENTS.append((time.perf_counter_ns(), threading.get_ident(), what, load, detail))


class TimedLock:
    """The engine's issue lock, logging each acquire (asked, got) and release."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        asked = time.perf_counter_ns()
        got = self._lock.acquire(blocking, timeout)
        if got:
            log("lock", getattr(_current, "load", None), asked)
        return got

    def release(self) -> None:
        log("unlock", getattr(_current, "load", None))
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def _wrap(cls, name: str, before, after=None) -> None:
    original = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        before(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        finally:
            if after:
                after(self, *args, **kwargs)

    setattr(cls, name, wrapped)


def _job_start(where: str):
    def before(engine, job, *_):
        _current.load = load_id(job.handle)
        log(where, _current.load, {"verified": job.check is not None,
                                    "partial": bool(job.beside_long_forward), "bytes": job.handle.nbytes})
    return before


def _job_end(where: str):
    def after(engine, job, *_):
        log(where, load_id(job.handle))
        _current.load = None
    return after


def _knobs() -> dict:
    """The CUDA engine's module knobs (upper-case ints and flags), as they are now."""
    return {k: v for k, v in vars(cuda_engine).items() if k.isupper() and type(v) in (int, bool)}


def install() -> None:
    cuda_engine.PROBE_SWITCH_US = 5000
    cuda_engine.PROBE_GC = 1
    defaults = _knobs()
    engine_cls = cuda_engine.CudaTransferEngine
    init = engine_cls.__init__

    def init_timed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._issue_lock = TimedLock()

    engine_cls.__init__ = init_timed
    _wrap(engine_cls, "_issue_here", _job_start("issue_here"), _job_end("issue_here_end"))
    _wrap(engine_cls, "_run_load", _job_start("run_load"), _job_end("run_load_end"))
    _wrap(engine_cls, "_copy_unit", lambda self, *a, **k: log("copy", getattr(_current, "load", None)))
    _wrap(engine_cls, "_scatter_fills",
          lambda self, job, ids, batch: log("scatter", load_id(job.handle), len(batch)))
    _wrap(LoadHandle, "_mark_layer", lambda self, layer, *a: log("mark", load_id(self), layer))
    _wrap(LoadHandle, "wait_layer_on_device", lambda self, layer, *a: log("wait", load_id(self), layer),
          lambda self, layer, *a: log("waited", load_id(self), layer))

    def gc_event(phase, info):
        log("gc_" + phase, None, info.get("generation"))

    gc.callbacks.append(gc_event)

    bench = ttft_gpu.Bench
    one_hit = bench.one_hit

    def one_hit_probed(self, eng, toks, cached, tag, *args, **kwargs):
        switch = sys.getswitchinterval()
        sys.setswitchinterval(cuda_engine.PROBE_SWITCH_US / 1e6)
        gc_off = not cuda_engine.PROBE_GC and gc.isenabled()
        if gc_off:
            gc.disable()
        arm = ",".join(f"{k}={v}" for k, v in _knobs().items() if v != defaults.get(k)) or "as shipped"
        log("hit", None, {"tag": tag, "arm": arm})
        try:
            return one_hit(self, eng, toks, cached, tag, *args, **kwargs)
        finally:
            log("hit_end")
            sys.setswitchinterval(switch)
            if gc_off:
                gc.enable()

    bench.one_hit = one_hit_probed


def gil_probe(stop: threading.Event) -> None:
    """Log each wake more than 200 us past a 50 us sleep."""
    while not stop.is_set():
        start = time.perf_counter_ns()
        time.sleep(50e-6)
        woke = time.perf_counter_ns()
        if woke - start > 200_000:
            log("late", None, start)


def loads(events: list[tuple]) -> list[dict]:
    """Each load's steps, in ms from its submit (None: not seen)."""
    hit = None
    out: dict = {}
    for ns, tid, what, load, detail in events:
        if what == "hit":
            hit = detail
        if what in ("issue_here", "run_load") and load not in out:
            out[load] = {"hit": hit, **detail, "t0": ns, "submitter": tid, "steps": []}
        if load in out:
            out[load]["steps"].append((ns, tid, what, detail))
    others = [(ns, tid, what, d) for ns, tid, what, _, d in events if what.startswith("gc_") or what == "late"]
    return [_summary(load, others) for load in out.values()]


def _summary(load: dict, others: list) -> dict:
    """One load's steps; ``others``: the collections and late wakes of every thread."""
    t0, submitter, steps = load["t0"], load["submitter"], load["steps"]

    def ms(ns):
        return None if ns is None else (ns - t0) / 1e6

    def first(pred):
        return next((s for s in steps if pred(s)), None)

    release = None
    for ns, tid, what, _ in steps:  # the submitter's last unlock of its issue
        if what == "unlock" and tid == submitter:
            release = ns
        if what == "issue_here_end":
            break
    taken = first(lambda s: s[2] == "run_load")
    locked = first(lambda s: s[2] == "lock" and taken is not None and s[1] == taken[1])
    copied = first(lambda s: s[2] == "copy" and taken is not None and s[1] == taken[1])
    wait0 = first(lambda s: s[2] == "wait" and s[3] == 0)
    waited0 = first(lambda s: s[2] == "waited" and s[3] == 0)
    mark0 = first(lambda s: s[2] == "mark" and s[3] == 0)
    end = steps[-1][0]
    pauses, late, starts = [], [], {}
    for ns, tid, what, detail in others:
        if what == "late":
            if t0 <= ns <= end:
                late.append((ms(detail), ms(ns)))
        elif what == "gc_start":
            starts[tid] = (ns, detail)
        elif what == "gc_stop" and tid in starts:
            begin, gen = starts.pop(tid)
            if begin <= end and ns >= t0:
                pauses.append({"from": ms(begin), "ms": (ns - begin) / 1e6, "gen": gen,
                               "thread": "submitter" if tid == submitter else "other"})
    return {k: load[k] for k in ("hit", "verified", "partial", "bytes")} | {
        "released": ms(release), "copy_thread_took": ms(taken and taken[0]),
        "copy_thread_asked_lock": ms(locked and locked[3]), "copy_thread_locked": ms(locked and locked[0]),
        "copy_thread_first_copy": ms(copied and copied[0]), "layer0_marked": ms(mark0 and mark0[0]),
        "wait0": ms(wait0 and wait0[0]), "waited0": ms(waited0 and waited0[0]),
        "end": ms(end), "gc": pauses, "late_wakes": late}


def report(summaries: list[dict]) -> str:
    lines = []
    keys = ("released", "copy_thread_took", "copy_thread_locked", "copy_thread_first_copy",
            "layer0_marked", "wait0", "waited0", "end")
    groups: dict = {}
    for s in summaries:
        hit = s["hit"] or {}
        groups.setdefault((s["partial"], s["verified"], hit.get("arm", "no hit")), []).append(s)
    for (partial, verified, arm), group in sorted(groups.items(), key=str):
        group = group[1:]  # the first is a warm-up
        if not group:
            continue
        med = {k: statistics.median(v) for k in keys
               if (v := [s[k] for s in group if s[k] is not None])}
        handover = [s["copy_thread_first_copy"] - s["released"] for s in group
                    if s["copy_thread_first_copy"] is not None and s["released"] is not None]
        gc_ms = [sum(p["ms"] for p in s["gc"]) for s in group]
        lines.append(
            f"{'partial' if partial else 'full'} {'verified' if verified else 'unverified'} "
            f"({arm}): {len(group)} loads; medians (ms from submit) "
            + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
            + (f"; hand-over (release to the copy thread's first copy) median "
               f"{statistics.median(handover):.2f}, max {max(handover):.2f}" if handover else "")
            + f"; gc during the load: {sum(1 for g in gc_ms if g)} loads, max {max(gc_ms):.2f} ms"
            + f"; late wakes: {sum(len(s['late_wakes']) for s in group)}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probe-out", required=True)
    p.add_argument("--gil-probe", action="store_true")
    p.add_argument("ttft_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    ttft_args = [a for a in args.ttft_args if a != "--"]
    install()
    stop = threading.Event()
    if args.gil_probe:
        threading.Thread(target=gil_probe, args=(stop,), daemon=True, name="gil-probe").start()
    try:
        ttft_gpu.main(ttft_args)
    finally:
        stop.set()
        summaries = loads(EVENTS)
        os.makedirs(args.probe_out, exist_ok=True)
        with open(os.path.join(args.probe_out, "handover.json"), "w") as f:
            json.dump(summaries, f)
        print(report(summaries))


if __name__ == "__main__":
    main()
