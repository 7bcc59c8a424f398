"""Host time a verified load's issue spends on checksums (CUDA, no vLLM).

    python3 bench/verify_issue_cost.py launches
        host time per call of the sum kernel's launch (with and without the
        fused comparison; through the driver directly, as shipped, and
        through Triton's launcher), of torch's sums, and of a load's check state
    python3 bench/verify_issue_cost.py harness [bench/ttft_gpu.py ARGS...]
        runs the GPU harness with the CUDA engine's issuing functions timed:
        calls, total and mean host time of each, printed at exit

Run from the project root with PYTHONPATH=connector:core:tools:tests/connector.
"""

from __future__ import annotations

import atexit
import collections
import runpy
import sys
import time

import numpy as np
import torch

from maru_connector.transfer import cuda as cuda_engine
from maru_connector.transfer import device_checksum as dc

ENGINE_FUNCTIONS = ("_issue_here", "_copy_unit", "_scatter_unit", "_sum_fills", "_due", "_check_state",
                    "_device_ids")


def host_time(label: str, call, repeats: int = 200) -> None:
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    per_call = (time.perf_counter() - start) / repeats
    torch.cuda.synchronize()
    print(f"{label}: {per_call * 1e6:.1f} us host per call")


def launches() -> None:
    device = torch.device("cuda", 0)
    for layerwise in (False, True):
        dc.warm_up(device, layerwise)
    print(f"backend {dc.BACKEND}, fused comparison {dc.FUSED_COMPARE}")
    staging = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    objects = 16  # a 4k-token chunkwise hit
    state = torch.zeros(3 * objects, dtype=torch.int64, device=device)
    sums, expected, verify = state[:objects], state[objects:2 * objects], state[2 * objects:]
    flags = torch.zeros(32, dtype=torch.int32, pin_memory=True)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    compare = dc.Compare(expected=expected, verify=verify, flags=flags, flag_index=0, counter=counter,
                         rows=objects, stride=1, first=0, cols=1)
    fill = dict(first_chunk=0, n_chunks=16, first_layer=0, n_layers=4, chunk_major=True, layerwise=False,
                total_layers=32)
    stream = torch.cuda.current_stream(device).cuda_stream  # as the engine passes its scatter stream
    print(f"variants launched through the driver: {sorted(dc._DIRECT)}")
    for row in (32 << 10, 256 << 10, 1 << 20):
        for direct in (True, False):
            dc.DIRECT_LAUNCH = direct
            how = "through the driver" if direct else "through Triton"
            host_time(f"sum, rows of {row >> 10} KiB, {how}",
                      lambda: dc.add_row_sums(sums, staging, 0, row, stream=stream, **fill))
            host_time(f"sum and compare, rows of {row >> 10} KiB, {how}",
                      lambda: dc.add_row_sums(sums, staging, 0, row, compare=compare, stream=stream, **fill))
        dc.DIRECT_LAUNCH = True
        host_time(f"torch's sum, rows of {row >> 10} KiB",
                  lambda: dc.add_row_sums(sums, staging, 0, row, backend="torch", **fill), repeats=50)
    empty = torch.zeros(1, device=device)
    host_time("an empty torch kernel (x.add_(1), for scale)", lambda: empty.add_(1))

    def check_state():  # as CudaTransferEngine._check_state makes it
        host = np.zeros(3 * objects, dtype=np.int64)
        torch.from_numpy(host).pin_memory().to(device, non_blocking=True)
        torch.zeros(32, dtype=torch.int32, pin_memory=True)

    host_time("a load's check state", check_state)


def harness(args: list[str]) -> None:
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])

    def timed(name: str, function):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                totals[name][0] += 1
                totals[name][1] += time.perf_counter() - start
        return call

    for name in ENGINE_FUNCTIONS:
        setattr(cuda_engine.CudaTransferEngine, name,
                timed(name, getattr(cuda_engine.CudaTransferEngine, name)))
    dc.add_row_sums = timed("add_row_sums", dc.add_row_sums)  # the engine calls it through the module

    def report() -> None:
        for name, (calls, seconds) in sorted(totals.items()):
            print(f"issue cost {name}: {calls} calls, {seconds * 1e3:.1f} ms, "
                  f"{seconds / max(calls, 1) * 1e6:.0f} us per call")

    atexit.register(report)
    sys.argv = ["bench/ttft_gpu.py", *args]
    runpy.run_path("bench/ttft_gpu.py", run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1:2] == ["launches"]:
        launches()
    elif sys.argv[1:2] == ["harness"]:
        harness(sys.argv[2:])
    else:
        sys.exit(__doc__)
