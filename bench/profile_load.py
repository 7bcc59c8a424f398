"""Where the time of one small load goes: a torch profiler timeline of the
copies and scatters on the GPU and the copy thread's calls, for one hit.

    PYTHONPATH=connector:core python3 bench/profile_load.py --tokens 1024 --layers 32
    ... bench/profile_load.py --tokens 1024 --concurrent 8     # 8 hits submitted at once
    ... bench/profile_load.py --tokens 4096 --host             # the copy thread's Python

Prints the GPU operations in time order (start, duration and gap after the
previous one on the same stream, in microseconds), then the busy time per
stream against the load's wall time. With ``--host``: the copy thread's
host time per load instead (its ``_run_load`` run on the main thread, alone,
then under cProfile: which calls cost it).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from transfer_gpu import Pool, chunks_of, make_kv, place
from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.transfer import ChunkLoad, ChunkStore, create_engine


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layerwise", action="store_true")
    ap.add_argument("--rows", type=int, default=60)
    ap.add_argument("--concurrent", type=int, default=1, help="loads submitted at once")
    ap.add_argument("--host", action="store_true", help="profile the copy thread's host time")
    args = ap.parse_args()
    bs, chunk = 16, 256
    blocks = args.tokens // bs
    n = args.concurrent
    kv = make_kv("packed_lbnhc", args.layers, (1 + n) * blocks, 8, bs, 128)
    fmt = ObjectFormat(detect_kv_layout(kv), chunk, args.layerwise)
    chunks = args.tokens // chunk
    pool = Pool(chunks * fmt.chunk_bytes + (2 << 20))
    perm = list(range((1 + n) * blocks))
    random.Random(0).shuffle(perm)
    offsets = place(fmt, chunks)
    engine = create_engine(pool.buffer, kv, fmt)
    try:
        assert engine.submit_store(chunks_of(perm[:blocks], offsets, chunk // bs,
                                             ChunkStore)).wait(60)
        loads = [chunks_of(perm[(1 + i) * blocks:(2 + i) * blocks], offsets, chunk // bs,
                           ChunkLoad) for i in range(n)]

        def run_all():
            t = time.perf_counter()
            handles = [engine.submit_load(load) for load in loads]
            assert all(h.wait_all(60) for h in handles)
            return time.perf_counter() - t

        if args.host:
            host_profile(engine, loads[0], args.rows)
            return
        walls = [run_all() for _ in range(5)]
        nbytes = n * blocks * fmt.layout.block_bytes_per_layer * args.layers
        print(f"{n} load(s) of {args.tokens} tokens, {args.layers} layers: best wall "
              f"{min(walls) * 1e3:.3f} ms, {nbytes / min(walls) / 1e9:.1f} GB/s (no profiler)")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = run_all()
        report(prof, wall, args.rows)
    finally:
        engine.close()
        pool.close()


def host_profile(engine, load, rows, repeats=50):
    """``_run_load`` of one load on this thread (the copy thread's work,
    without its wake-up or the GIL shared with a forward)."""
    import cProfile
    import pstats

    from maru_connector.transfer.backend import TransferJob
    from maru_connector.transfer.handles import LoadHandle
    from maru_connector.transfer.plan import check_chunks

    def one():
        blocks = check_chunks(engine.fmt, load, "load")
        handle = LoadHandle(engine.layout.num_layers, 0)
        job = TransferJob(handle, blocks, [c[1] for c in load])
        engine._prepare(job)
        t = time.perf_counter()
        engine._run_load(job)
        issue = time.perf_counter() - t
        assert handle.wait_all(60)
        return issue

    for _ in range(5):
        one()
    issues = sorted(one() for _ in range(repeats))
    print(f"copy thread's host time per load: median {issues[len(issues) // 2] * 1e3:.3f} ms, "
          f"min {issues[0] * 1e3:.3f} ms ({engine.layout.num_layers} layers)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        one()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows // 2)


def report(prof, wall, rows):
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    if not events:
        print("no GPU events recorded")
        return
    t0 = events[0].time_range.start
    last_end: dict = {}
    busy: dict = {}
    print(f"{'start':>8} {'dur':>7} {'gap':>6} stream name")
    for i, e in enumerate(events):
        s, d = e.time_range.start, e.time_range.elapsed_us()
        stream = getattr(e, "device_resource_id", 0)
        gap = s - last_end.get(stream, s)
        last_end[stream] = s + d
        busy[stream] = busy.get(stream, 0) + d
        if i < rows:
            print(f"{s - t0:8.1f} {d:7.1f} {gap:6.1f} {stream:>6} {e.name[:60]}")
    span = max(e.time_range.end for e in events) - t0
    print(f"wall {wall * 1e6:.0f} us; GPU span {span:.0f} us; busy per stream (us):",
          {k: round(v) for k, v in busy.items()})
    cpu = [e for e in prof.key_averages() if e.key.startswith(("aten::index_copy_", "cuda"))]
    for e in cpu[:12]:
        print(f"host {e.key[:50]:50} calls {e.count:4d} total {e.cpu_time_total:8.0f} us")


if __name__ == "__main__":
    main()
