"""What a head start costs the engine thread (CUDA): the host time of
``start_head`` for a 4k-token chunkwise hit of a Llama-3-8B-sized cache, and
how long the small host-to-device copies that prepare a step (a 1-token
batch's inputs) take while the head's copies are in flight, pageable
(``torch.tensor(..., device=)``, synchronous) and pinned (``non_blocking``,
as vLLM's model runner copies them). Medians of ``--repeats``.

    PYTHONPATH=connector:core:tests/connector python3 bench/head_start_probe.py
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
import uuid

import torch

from kv_builders import make_kv_caches
from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.transfer import create_engine

CHUNK_TOKENS, BLOCK = 256, 16


def _inputs(pinned: bool, n_ids: int = 256) -> list[torch.Tensor]:
    host = [torch.arange(n_ids, dtype=torch.int64)] + [torch.tensor([7], dtype=torch.int64)] * 4
    return [h.pin_memory() for h in host] if pinned else host


def _copy_inputs(host: list[torch.Tensor], pinned: bool) -> None:
    for h in host:
        if pinned:
            h.to("cuda", non_blocking=True)
        else:
            torch.tensor(h.tolist(), dtype=torch.int64, device="cuda")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--head-mib", type=int, nargs="+", default=[16, 32, 64])
    args = p.parse_args()
    chunks = args.tokens // CHUNK_TOKENS
    blocks = chunks * CHUNK_TOKENS // BLOCK
    kv = make_kv_caches("packed_lbnhc", layers=32, blocks=blocks, heads=8, block_size=BLOCK,
                        head_size=128, device="cuda", seed=1, shuffle=False)
    fmt = ObjectFormat(detect_kv_layout(kv), CHUNK_TOKENS, False)
    size = chunks * fmt.object_bytes + (64 << 20)
    path = f"/dev/shm/maru-probe-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    pool = mmap.mmap(fd, size, mmap.MAP_SHARED)
    os.close(fd)
    sources = [(c * fmt.object_bytes,) for c in range(chunks)]
    print(f"{torch.cuda.get_device_name()}, {args.tokens} tokens chunkwise, "
          f"{fmt.layer_bytes * chunks >> 20} MiB per layer; ms, median of {args.repeats}")
    try:
        for head_mib in args.head_mib:
            engine = create_engine(memoryview(pool), kv, fmt, head_start_bytes=head_mib << 20)
            for pinned in (False, True):
                host = _inputs(pinned)
                start, alone, beside = [], [], []
                for _ in range(args.repeats + 2):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    _copy_inputs(host, pinned)
                    torch.cuda.synchronize()
                    alone.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    head = engine.start_head(sources)
                    t1 = time.perf_counter()
                    _copy_inputs(host, pinned)
                    torch.cuda.current_stream().synchronize()
                    t2 = time.perf_counter()
                    assert head is not None
                    head.drop()
                    torch.cuda.synchronize()
                    start.append(t1 - t0)
                    beside.append(t2 - t1)
                med = lambda xs: statistics.median(xs[2:]) * 1e3  # noqa: E731
                print(f"head {head_mib:3d} MiB, inputs {'pinned' if pinned else 'pageable'}: "
                      f"start_head {med(start):.3f}, inputs alone {med(alone):.3f}, "
                      f"inputs beside the head's copies {med(beside):.3f}")
            engine.close()
    finally:
        os.unlink(path)  # the mapping goes with the process (engines keep views of it)


if __name__ == "__main__":
    main()
