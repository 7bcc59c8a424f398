"""What the payload checksum costs on the GPU, per GB, against the copy it guards.

A verified load sums each staging fill on the device before its scatter
(``maru_connector.transfer.device_checksum``). This times that sum alone,
fill by fill as a load issues it (64 MiB fills of 1 MiB rows: a 16k-token
Llama-8B hit in 256-token chunks, 2 GiB), for the Triton kernel and the
torch fallback, against the pinned host-to-device copy of the same bytes,
and checks the sums bit for bit against numpy on a sample of the rows.

    python3 bench/checksum_gpu.py --gib 2 --out OUT.json
    python3 bench/checksum_gpu.py --device cpu --gib 0.125   # a dry run of the script (torch sums)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from maru_core.pool.checksum import position_sum

from maru_connector.transfer import device_checksum

GB = 1e9


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn`` (on the GPU: between CUDA events)."""
    times = []
    for _ in range(repeats + 1):
        if device.type != "cuda":
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="bytes summed (a 16k-token hit: 2)")
    parser.add_argument("--row-mib", type=float, default=1.0, help="one layer of one chunk")
    parser.add_argument("--fill-mib", type=int, default=64, help="one staging fill")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of this script")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    row = int(args.row_mib * (1 << 20))
    fill = args.fill_mib << 20
    rows_per_fill = fill // row
    fills = max(1, int(args.gib * (1 << 30)) // fill)
    nbytes = fills * fill
    device = torch.device(args.device)
    staging = torch.randint(0, 256, (fill,), dtype=torch.uint8, device=device)
    sums = torch.zeros(rows_per_fill * fills, dtype=torch.int64, device=device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        device_checksum.warm_up(device, layerwise=False)

    def sum_all(backend: str) -> None:
        for f in range(fills):  # chunkwise rows: chunk r, layer f (global position weights)
            device_checksum.add_row_sums(sums, staging, 0, row, first_chunk=0, n_chunks=rows_per_fill,
                                         first_layer=f, n_layers=1, chunk_major=False, layerwise=False,
                                         total_layers=fills, backend=backend)

    result = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch_version": torch.__version__,
              "backend": device_checksum.BACKEND, "bytes": nbytes, "row_bytes": row, "fill_bytes": fill}
    for backend in ("triton", "torch") if on_gpu and device_checksum.BACKEND == "triton" else ("torch",):
        seconds = timed(lambda: sum_all(backend), args.repeats, device)
        result[backend] = {"ms": round(seconds * 1e3, 3), "gb_per_s": round(nbytes / seconds / GB, 1),
                           "ms_per_gb": round(seconds * 1e3 / (nbytes / GB), 3)}
    host = torch.empty(fill, dtype=torch.uint8, pin_memory=on_gpu)
    copy_s = timed(lambda: [staging.copy_(host, non_blocking=True) for _ in range(fills)], args.repeats, device)
    result["h2d_copy"] = {"ms": round(copy_s * 1e3, 3), "gb_per_s": round(nbytes / copy_s / GB, 1)}
    for backend in ("triton", "torch"):
        if backend in result:
            result[backend]["share_of_copy"] = round(result[backend]["ms"] / result["h2d_copy"]["ms"], 4)
    # Bit for bit: one fill's sums against numpy.
    sums.zero_()
    device_checksum.add_row_sums(sums, staging, 0, row, first_chunk=0, n_chunks=rows_per_fill, first_layer=3,
                                 n_layers=1, chunk_major=False, layerwise=False, total_layers=fills)
    data = staging.cpu().numpy()
    want = [position_sum(data[r * row:(r + 1) * row], 3 * row // 4) for r in range(rows_per_fill)]
    result["bits_equal_numpy"] = device_checksum.as_uint64(sums[:rows_per_fill].cpu()) == want
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if not result["bits_equal_numpy"]:
        raise SystemExit("device sums differ from numpy")


if __name__ == "__main__":
    np.random.seed(0)
    main()
