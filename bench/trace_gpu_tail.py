"""Where a hit's GPU time goes, from the Chrome trace of ``bench/ttft_gpu.py --profile``.

    python3 bench/trace_gpu_tail.py TRACE.json [TRACE.json ...]

For each trace (one profiled hit): per GPU stream, what it ran (copies,
checksum sums, scatters, the forward's kernels) and for how long; the end of
the last host-to-device copy, of the last sum, of the last scatter and of
the forward's last kernel, from the first copy's start; the copy engine's
idle spells, each with whether the host asked for the next copy late or the
copy waited on the GPU; how long sums ran
while the forward had a kernel running (time they shared the GPU); and the
forward stream's idle time inside the hit (waits for layers). Two traces of
the same hit, verified and not, side by side show what verification adds
and where: at the tail (after the last copy) or all along.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def classify(event: dict) -> str:
    name = event.get("name", "")
    cat = event.get("cat", "")
    if cat == "gpu_memcpy" or "Memcpy" in name:
        return "copy" if "Pinned -> Device" in name else "memcpy"
    if "row_sums" in name:
        return "sum"
    if "index" in name.lower() and ("copy" in name.lower() or "put" in name.lower() or "scatter" in name.lower()):
        return "scatter"
    return "kernel"


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time two sets of intervals overlap (b merged first)."""
    merged: list[list[float]] = []
    for s, e in sorted(b):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    total = 0.0
    for s, e in a:
        for ms, me in merged:
            total += max(0.0, min(e, me) - max(s, ms))
    return total


def top_names(evs, n: int = 4) -> list:
    """A stream's most time-consuming op names: [name, count, ms]."""
    by: dict = defaultdict(lambda: [0, 0.0])
    for s, e, _, name in evs:
        by[name[:60]][0] += 1
        by[name[:60]][1] += e - s
    return [[k, c, round(t / 1e3, 3)] for k, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:n]]


def analyse(path: str) -> dict:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"trace": path, "error": "no GPU events"}
    streams: dict = defaultdict(list)
    for e in gpu:
        streams[e.get("tid")].append((e["ts"], e["ts"] + e.get("dur", 0), classify(e), e.get("name", "")))
    # the load's copies: the stream that copied the most from pinned memory
    # (the scatter stream's few small uploads, block ids and checks, are not them)
    copy_tid = max(streams, key=lambda t: sum(e - s for s, e, kind, _ in streams[t] if kind == "copy"))
    copies = sorted((s, e) for s, e, kind, _ in streams[copy_tid] if kind == "copy")
    # when the host asked for each of those copies (its runtime call, matched by correlation id)
    asked = {e["args"]["correlation"]: e["ts"] for e in events
             if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    copy_asked = sorted((e["ts"], asked.get(e.get("args", {}).get("correlation"))) for e in gpu
                        if e.get("tid") == copy_tid and classify(e) == "copy")
    t0 = copies[0][0] if copies else min(s for evs in streams.values() for s, _, _, _ in evs)
    # the forward's stream: the one with the most plain kernels and no copies or sums
    loaders = {t for t, evs in streams.items() if any(k in ("copy", "sum") for *_, k, _ in evs)}
    forward_tid = max((t for t in streams if t not in loaders) or streams,
                      key=lambda t: sum(1 for *_, kind, _ in streams[t] if kind == "kernel"))
    fwd = sorted((s, e) for s, e, kind, _ in streams[forward_tid] if kind == "kernel")
    sums = [(s, e) for evs in streams.values() for s, e, kind, _ in evs if kind == "sum"]
    scatters = [(s, e) for evs in streams.values() for s, e, kind, _ in evs if kind == "scatter"]
    gaps = sum(max(0.0, b[0] - a[1]) for a, b in zip(fwd, fwd[1:]))
    out = {
        "trace": path,
        "streams": {str(t): {kind: {"n": sum(1 for *_, k, _ in evs if k == kind),
                                     "busy_ms": round(sum(e - s for s, e, k, _ in evs if k == kind) / 1e3, 3)}
                             for kind in sorted({k for *_, k, _ in evs})}
                    for t, evs in streams.items()},
        "top_kernels": {str(t): top_names(evs) for t, evs in streams.items()},
        "forward_stream": str(forward_tid),
        "last_copy_end_ms": round((copies[-1][1] - t0) / 1e3, 3) if copies else None,
        "last_sum_end_ms": round((max(e for _, e in sums) - t0) / 1e3, 3) if sums else None,
        "last_scatter_end_ms": round((max(e for _, e in scatters) - t0) / 1e3, 3) if scatters else None,
        "forward_first_kernel_ms": round((fwd[0][0] - t0) / 1e3, 3) if fwd else None,
        "forward_end_ms": round((fwd[-1][1] - t0) / 1e3, 3) if fwd else None,
        "forward_idle_ms": round(gaps / 1e3, 3),
        "sum_busy_ms": round(sum(e - s for s, e in sums) / 1e3, 3),
        "sum_beside_forward_ms": round(overlap(sums, fwd) / 1e3, 3),
        "scatter_busy_ms": round(sum(e - s for s, e in scatters) / 1e3, 3),
        "scatter_beside_forward_ms": round(overlap(scatters, fwd) / 1e3, 3),
        # the copy engine's idle spells between a load's copies (the first is
        # the wait from a head start's copies to the load's own)
        # and for each, whether the host asked for the next copy only after the
        # copy engine ran dry ("host": the host's issue was late) or before ("device":
        # the copy waited on the GPU, e.g. for a staging span's scatter)
        "copy_gaps_ms": [[i + 1, round((b[0] - a[1]) / 1e3, 3),
                          "host" if copy_asked[i + 1][1] is not None and copy_asked[i + 1][1] > a[1] else "device"]
                         for i, (a, b) in enumerate(zip(copies, copies[1:])) if b[0] - a[1] > 50],
        "forward_after_last_copy_ms": (round((fwd[-1][1] - copies[-1][1]) / 1e3, 3) if fwd and copies else None),
    }
    # the forward's kernels that ran after the last copy: the tail a hit pays past its bytes
    if fwd and copies:
        tail = [(s, e) for s, e in fwd if e > copies[-1][1]]
        out["forward_kernels_after_last_copy"] = len(tail)
        out["forward_busy_after_last_copy_ms"] = round(sum(e - max(s, copies[-1][1]) for s, e in tail) / 1e3, 3)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for path in argv:
        print(json.dumps(analyse(path), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
