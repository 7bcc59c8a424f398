"""A load's scatter of one staging fill into vLLM's paged blocks, the ways the
CUDA engine can issue it: torch's ``index_copy_`` (8-byte elements, as the
engine's torch path), that plus the checksum kernel's sum and comparison (a
verified fill without the fused scatter), and the fused scatter
(``transfer/scatter_sum.py``) without and with its sum and comparison.

For each: host time per call (what the engine thread pays; calls queued back
to back, then one synchronize) and GPU time per call (CUDA events around the
same loop), over a Llama-3-8B-shaped cache (32 layers, flash-attention NHD
layout, bf16, 8 KV heads of 128, blocks of 16 tokens) and fills of one
layer's 256 blocks (a 4k-token hit's 16 MiB) and 1024 (64 MiB); and for
the 16 MiB fills, what 32 of them on a high-priority stream cost GEMMs
queued before them on another (a forward beside its load). Every
variant's blocks are checked equal to torch's, and the sums to the checksum
kernel's, before timing.

    PYTHONPATH=connector:core python3 bench/scatter_kernel_ab.py [--calls 200] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from maru_connector.transfer import device_checksum, scatter_sum
from maru_connector.transfer.device_checksum import Compare

LAYERS, HEADS, HEAD, TOKENS = 32, 8, 128, 16
BLOCKS = 2048  # per layer: 128 MiB, 4 GiB in all
BPC = 16  # blocks per chunk: 256-token chunks


def _cache(device):
    """One buffer, each layer a (2, blocks, 16, 8, 128) bf16 view; the block views
    (uint8 [blocks, 2 segments, segment bytes]) as the engine holds them."""
    per_layer = 2 * BLOCKS * TOKENS * HEADS * HEAD
    backing = torch.empty(LAYERS * per_layer, dtype=torch.bfloat16, device=device)
    seg = TOKENS * HEADS * HEAD * 2
    views = [torch.as_strided(backing.view(torch.uint8), (BLOCKS, 2, seg), (seg, BLOCKS * seg, 1), i * per_layer * 2)
             for i in range(LAYERS)]
    return backing, views, seg


def _timed(fn, calls: int) -> tuple[float, float]:
    """(host us per call: the median of calls each made on an idle GPU, so
    that no full launch queue holds the host; GPU us per call: events around
    ``calls`` calls queued back to back)."""
    fn()
    host = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return statistics.median(host) * 1e6, start.elapsed_time(end) / calls * 1e3


def _beside_gemms(fn, rounds: int = 9) -> float:
    """What 32 calls of ``fn`` on a high-priority stream (a 4k-token hit's
    scatters) cost 16 bf16 GEMMs of 4096 x 4096 queued before them on another
    stream (a forward), in us: the median over ``rounds`` of the GEMMs'
    time with the calls minus without."""
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    compute, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    costs = []
    for _ in range(rounds):
        spans = []
        for calls in (0, 32):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(compute):
                start.record()
                for _ in range(16):
                    a @ a
                end.record()
            with torch.cuda.stream(high):
                for _ in range(calls):
                    fn()
            end.synchronize()
            spans.append(start.elapsed_time(end) * 1e3)
        costs.append(spans[1] - spans[0])
    return statistics.median(costs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda", 0)
    for layerwise in (False, True):
        device_checksum.warm_up(device, layerwise)
        assert scatter_sum.warm_up(device, layerwise), "the fused scatter did not warm up on this GPU"
    backing, views, seg = _cache(device)
    bpl = 2 * seg
    layout = type("Layout", (), dict(segment_bytes=seg, segment_stride_bytes=BLOCKS * seg, block_stride_bytes=seg,
                                     layer_stride_bytes=views[1].data_ptr() - views[0].data_ptr(),
                                     block_segments=2))
    target = scatter_sum.ScatterTarget.of(views, layout, BPC, True)
    wide = [v.view(torch.int64) for v in views]
    results = {"gpu": torch.cuda.get_device_name(0), "calls": args.calls, "cases": []}
    for blocks in (256, 1024):
        staging = torch.randint(0, 256, (blocks * bpl,), dtype=torch.uint8, device=device)
        ids = torch.randperm(BLOCKS, device=device)[:blocks]
        source = staging.view(torch.int64).view(blocks, 2, seg // 8)
        chunks = blocks // BPC
        sums = torch.zeros(chunks * LAYERS, dtype=torch.int64, device=device)
        flags = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        compare = Compare(expected=torch.zeros_like(sums), verify=torch.zeros_like(sums), flags=flags, flag_index=0,
                          counter=counter, rows=chunks, stride=LAYERS, first=5, cols=1)
        fill = scatter_sum.Fill(staging, 0, 5, 1, 0, blocks, 0, 0, blocks)
        shifted = torch.cat([torch.zeros(8, dtype=torch.uint8, device=device), staging])  # runs off 16 bytes
        unit1 = scatter_sum.Fill(shifted, 8, 5, 1, 0, blocks, 0, 0, blocks)
        row = BPC * bpl
        sum_args = dict(first_chunk=0, n_chunks=chunks, first_layer=5, n_layers=1, chunk_major=False, layerwise=True,
                        total_layers=LAYERS)
        ways = {
            "torch index_copy_": lambda: wide[5].index_copy_(0, ids, source),
            "torch index_copy_ + sum and compare launch": lambda: (
                device_checksum.add_row_sums(sums, staging, 0, row, compare=compare, **sum_args),
                wide[5].index_copy_(0, ids, source)),
            "fused scatter": lambda: scatter_sum.scatter(target, fill, ids),
            "fused scatter, runs off 16 bytes (unit 1)": lambda: scatter_sum.scatter(target, unit1, ids),
            "fused scatter, sum and compare": lambda: scatter_sum.scatter(
                target, fill, ids, sums=sums, layerwise=True, total_layers=LAYERS, compare=compare),
        }
        want_sums = torch.zeros_like(sums)
        device_checksum.add_row_sums(want_sums, staging, 0, row, backend="torch", **sum_args)
        for name, fn in ways.items():  # each lands the same blocks and sums before it is timed
            views[5].zero_()
            sums.zero_()
            fn()
            torch.cuda.synchronize()
            assert torch.equal(views[5][ids.cpu()].reshape(blocks, -1), staging.view(blocks, -1)), name
            if "sum" in name:
                assert torch.equal(sums, want_sums), name
        for name, fn in ways.items():
            host, gpu = _timed(fn, args.calls)
            beside = _beside_gemms(fn) if blocks == 256 else None
            case = {"blocks": blocks, "mib": blocks * bpl / 2**20, "way": name, "host_us": round(host, 1),
                    "gpu_us": round(gpu, 1), "gb_per_s": round(blocks * bpl / (gpu * 1e-6) / 1e9, 1),
                    "cost_to_gemms_us": None if beside is None else round(beside, 1)}
            results["cases"].append(case)
            print(f"{case['mib']:5.0f} MiB  {name:45s} host {case['host_us']:6.1f} us  GPU {case['gpu_us']:6.1f} us"
                  f"  ({case['gb_per_s']} GB/s)" + ("" if beside is None else
                                                    f"  32 of them cost GEMMs beside {beside:.0f} us"), flush=True)
    del backing
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
