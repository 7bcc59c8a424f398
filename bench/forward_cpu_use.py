"""How much of the machine a partial hit's forward leaves idle (vLLM CPU engine).

Overlap hides a load behind compute only where the copies find a core the
forward is not using. On the CPU backend the copies are memory copies on
host cores, so this measures, for the forward a partial hit runs (``--new``
tokens computed over a ``--cached``-token prefix held in vLLM's own prefix
cache, no connector), how many cores it keeps busy: the CPU seconds of
every process of the engine (psutil, children included) over the
request's wall time, per request and in total, against the cores the
machine has. The engine runs as the TTFT benchmarks run it (OpenMP with
passive waits, one thread per core).

    .venv/bin/python bench/forward_cpu_use.py [--cached 2048] [--new 2048] [--prompts 8] [--mp off on]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import psutil

from maru_tools.engine import EngineProcess, EngineSpec
from maru_tools.tiny_model import TinyModelSpec, build_tiny_model
from maru_tools.workload import random_tokens


def _cpu_seconds(root: psutil.Process) -> float:
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def measure(model_dir: str, args, mp: bool) -> dict:
    longest = args.cached + args.new
    spec = EngineSpec(model_dir=model_dir, block_size=128, max_model_len=longest + 128,
                      max_num_batched_tokens=longest + 128, multiprocessing=mp,
                      enable_prefix_caching=True,
                      env={"OMP_NUM_THREADS": str(os.cpu_count() or 1), "OMP_WAIT_POLICY": "PASSIVE"})
    log = os.path.join(tempfile.mkdtemp(prefix="marucache-cpu-use-"), "engine.log")
    rows = []
    with EngineProcess(spec, log) as engine:
        root = psutil.Process(engine.pid)
        engine.generate([random_tokens(256, seed=1)], max_tokens=1)  # warm-up
        for i in range(args.prompts + 1):
            prefix = random_tokens(args.cached, seed=100 + i)
            engine.generate([prefix], max_tokens=1)  # now in vLLM's prefix cache
            prompt = prefix + random_tokens(args.new, seed=10_000 + i)
            time.sleep(0.2)
            cpu0, wall0 = _cpu_seconds(root), time.perf_counter()
            (result,) = engine.generate([prompt], max_tokens=1)
            cpu, wall = _cpu_seconds(root) - cpu0, time.perf_counter() - wall0
            if i:
                rows.append({"wall_s": wall, "ttft_s": result.ttft_s, "cpu_s": cpu})
    busy = [r["cpu_s"] / r["wall_s"] for r in rows]
    return {"multiprocessing": mp, "rows": rows,
            "median_ttft_ms": statistics.median(r["ttft_s"] for r in rows) * 1e3,
            "median_busy_cores": statistics.median(busy), "min_busy_cores": min(busy),
            "max_busy_cores": max(busy)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cached", type=int, default=2048)
    p.add_argument("--new", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--mp", nargs="+", choices=["off", "on"], default=["off", "on"])
    args = p.parse_args()
    model_dir = str(build_tiny_model(TinyModelSpec(max_position_embeddings=max(8192, 2 * (args.cached + args.new)))))
    cores = os.cpu_count()
    for mp in args.mp:
        m = measure(model_dir, args, mp == "on")
        print(f"{args.cached} cached + {args.new} new tokens, multiprocessing {mp}: first token "
              f"{m['median_ttft_ms']:.1f} ms (median of {len(m['rows'])}); the engine kept "
              f"{m['median_busy_cores']:.2f} of {cores} cores busy (range "
              f"{m['min_busy_cores']:.2f}-{m['max_busy_cores']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
