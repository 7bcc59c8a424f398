"""The payload checksum kernel as shipped against a candidate that splits the
position weight: sum_j (b + j + 1) * w_j = (b + 1) * sum_j w_j + sum_j j * w_j,
where j * w_j is a 32 x 32 -> 64-bit product (one wide multiply on NVIDIA GPUs)
instead of a 64 x 64-bit one.

    python3 bench/checksum_kernel_ab.py [--repeats 50]

Times each kernel alone over fills as a 4k-token Llama-8B hit stages them
(16 MiB: one layer of 16 chunks of 1 MiB rows; 64 MiB: a batch of four
layers) and over 2 GiB in 64 MiB fills, checks the candidate's sums equal
the shipped kernel's, and prints GB/s per variant (JSON).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from maru_connector.transfer import device_checksum


@triton.jit
def _split_weight_kernel(data_ptr, sums_ptr, start_word, row_words, n_chunks, n_layers, first_chunk, first_layer,
                         total_layers, layer_words, BLOCK: tl.constexpr):
    """Chunkwise, layer-major rows only (what the A/B needs): the shipped kernel's sums."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    k = row // n_chunks
    r = row % n_chunks
    obj = (first_chunk + r).to(tl.int64)
    base = (first_layer + k).to(tl.int64) * layer_words
    row_start = start_word + row.to(tl.int64) * row_words
    offsets = tl.arange(0, BLOCK)
    plain = tl.zeros([BLOCK], dtype=tl.int64)
    weighted = tl.zeros([BLOCK], dtype=tl.int64)
    for step in range(part * BLOCK, row_words, parts * BLOCK):
        idx = step + offsets
        inside = idx < row_words
        words = tl.load(data_ptr + row_start + idx, mask=inside, other=0).to(tl.uint32, bitcast=True)
        plain += words.to(tl.int64)
        weighted += (idx.to(tl.uint32).to(tl.uint64) * words.to(tl.uint64)).to(tl.int64, bitcast=True)
    total = (base + 1) * tl.sum(plain, axis=0) + tl.sum(weighted, axis=0)
    tl.atomic_add(sums_ptr + obj, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    device_checksum.warm_up(device, layerwise=False)
    row = 1 << 20
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for fill_mib, fills in ((16, 1), (64, 1), (64, 32)):
        fill = fill_mib << 20
        layers = fill // row // 16
        staging = torch.randint(0, 256, (fill,), dtype=torch.uint8, device=device)
        words = staging.view(torch.int32)
        got = {}
        timings = {}

        def shipped(sums):
            for f in range(fills):
                device_checksum.add_row_sums(sums, staging, 0, row, first_chunk=0, n_chunks=16, first_layer=f * layers,
                                             n_layers=layers, chunk_major=False, layerwise=False,
                                             total_layers=fills * layers)

        def candidate(sums, warps):
            row_words = row // 4
            grid = (16 * layers, min(64, -(-row_words // 4096)))
            for f in range(fills):
                _split_weight_kernel[grid](words, sums, 0, row_words, 16, layers, 0, f * layers, fills * layers,
                                           row_words, BLOCK=1024, num_warps=warps)

        variants = {"shipped": shipped, "split_w4": lambda s: candidate(s, 4), "split_w8": lambda s: candidate(s, 8)}
        for name, fn in variants.items():
            sums = torch.zeros(16, dtype=torch.int64, device=device)
            fn(sums)
            torch.cuda.synchronize()
            got[name] = sums.clone()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                fn(sums)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / args.repeats
            timings[name] = {"us": round(seconds * 1e6, 1), "gb_per_s": round(fill * fills / seconds / 1e9, 1)}
        for name in variants:
            timings[name]["equal_to_shipped"] = bool(torch.equal(got[name], got["shipped"]))
        result[f"{fill_mib} MiB x {fills}"] = timings
        del staging, words
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
