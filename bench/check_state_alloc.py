"""Host time to stage a verified load's check state on the GPU (CUDA only).

    PYTHONPATH=connector python3 bench/check_state_alloc.py [--objects 16 512] [--iterations 2000]

A verified load uploads one int64 array of three parts per object (sums at
0, expected sums, whether to verify) in one pinned, non-blocking copy at its
first fill (``CudaTransferEngine._check_state``). Two ways to get the pinned
array: a pageable numpy array pinned with ``pin_memory()`` (before), or a
tensor taken pinned from torch's caching host allocator and filled in place
(now). Prints the median and p90 host time of each, in microseconds, for a
4k-token hit's objects (16 chunkwise, 512 layerwise at 32 layers), the two
ways alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def pinned_from_numpy(expected: np.ndarray, verify: np.ndarray, device) -> torch.Tensor:
    n = len(expected)
    host = np.zeros(3 * n, dtype=np.int64)
    host[n:2 * n] = expected
    host[2 * n:] = verify
    return torch.from_numpy(host).pin_memory().to(device, non_blocking=True)


def filled_in_place(expected: np.ndarray, verify: np.ndarray, device) -> torch.Tensor:
    n = len(expected)
    staged = torch.empty(3 * n, dtype=torch.int64, pin_memory=True)
    host = staged.numpy()
    host[:n] = 0
    host[n:2 * n] = expected
    host[2 * n:] = verify
    return staged.to(device, non_blocking=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, nargs="+", default=[16, 512])
    p.add_argument("--iterations", type=int, default=2000)
    args = p.parse_args()
    device = torch.device("cuda")
    ways = {"pin_memory() of a numpy array": pinned_from_numpy, "pinned tensor filled in place": filled_in_place}
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for n in args.objects:
        rng = np.random.default_rng(n)
        expected = rng.integers(-2**62, 2**62, n, dtype=np.int64)
        verify = np.ones(n, dtype=np.int64)
        want = torch.from_numpy(np.concatenate([np.zeros(n, np.int64), expected, verify])).to(device)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for i in range(args.iterations + 50):
            for name, way in ways.items():
                t = time.perf_counter()
                got = way(expected, verify, device)
                elapsed = time.perf_counter() - t
                if i >= 50:  # after the caching allocator has its blocks
                    times[name].append(elapsed)
                if i % 500 == 0:
                    torch.cuda.synchronize()
                    assert torch.equal(got, want), name
        torch.cuda.synchronize()
        for name, xs in times.items():
            xs.sort()
            print(f"{n} objects, {name}: median {statistics.median(xs) * 1e6:.1f} us, "
                  f"p90 {xs[int(0.9 * len(xs))] * 1e6:.1f} us")


if __name__ == "__main__":
    main()
