"""TTFT with a cache hit vs recompute on the vLLM CPU engine.

    .venv/bin/python bench/ttft_cpu.py [--sizes 1024 2048 4096] [--repeats 3]

For each format (chunkwise, layerwise) engine A serves fresh prompts (a miss:
prefill plus store) and engine B, another process, serves the same prompts
from the pool (a hit). A third engine without the connector gives the
recompute baseline. The model is a randomly initialised Llama large enough
that prefill dominates a CPU step (`BENCH_SPEC`: 4 layers, hidden 1024,
16 heads / 8 KV heads). Prints a Markdown table (medians) and writes the raw
figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack

from maru_connector.config import make_kv_transfer_config
from maru_tools.engine import EngineProcess, EngineSpec
from maru_tools.index_process import IndexProcess, unique_pool_path
from maru_tools.stats_reader import read_connector_stats
from maru_tools.tiny_model import BENCH_SPEC, build_tiny_model
from maru_tools.workload import random_tokens

FORMATS = {"chunkwise": False, "layerwise": True}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--sync-load", action="store_true", help="synchronous loads (default: async + overlap)")
    p.add_argument("--json", default=os.path.join("out", "ttft_cpu.json"))
    return p.parse_args()


def _wait_keys(index: IndexProcess, at_least: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while int(index.stats()["keys"]) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"stores did not reach {at_least} keys")
        time.sleep(0.05)


def main() -> int:
    args = _parse()
    workdir = tempfile.mkdtemp(prefix="marucache-bench-")
    model_dir = str(build_tiny_model(BENCH_SPEC))
    longest = max(args.sizes)
    base = EngineSpec(model_dir=model_dir, block_size=32, max_model_len=longest + 64,
                      max_num_batched_tokens=longest + 64, num_gpu_blocks_override=(longest + 64) // 32 * 2 + 8,
                      env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)})
    results: dict = {"sizes": args.sizes, "repeats": args.repeats, "model": BENCH_SPEC.__dict__, "formats": {}}
    with ExitStack() as stack:
        index = IndexProcess(unique_pool_path("marucache-bench"), pool_size="2Gi", log_dir=workdir)
        stack.callback(index.close)
        index.start()
        reference = EngineProcess(base, os.path.join(workdir, "reference.log"))
        stack.callback(reference.close)
        results["recompute"] = _measure(reference, args, seed_base=0)
        for fmt in args.formats:
            knobs = dict(kv_chunk_tokens=args.chunk_tokens, use_layerwise=FORMATS[fmt],
                         async_load=not args.sync_load, overlap_load_with_compute=not args.sync_load,
                         lookup_timeout_s=1.0)
            stats = {n: os.path.join(workdir, f"stats-{fmt}-{n}") for n in "AB"}
            engine = {}
            for n in "AB":
                os.makedirs(stats[n])
                config = make_kv_transfer_config(index.url, pool_path=index.pool_path, token=index.token,
                                                 stats_dir=stats[n], **knobs)
                engine[n] = EngineProcess(EngineSpec(**{**base.__dict__, "kv_transfer_config": config}),
                                          os.path.join(workdir, f"{fmt}-{n}.log"))
                stack.callback(engine[n].close)
            per_layer = BENCH_SPEC.num_layers if FORMATS[fmt] else 1
            keys_before = int(index.stats()["keys"])
            miss = _measure(engine["A"], args, seed_base=0)
            _wait_keys(index, keys_before + sum(n // args.chunk_tokens * per_layer * args.repeats for n in args.sizes))
            hit = _measure(engine["B"], args, seed_base=0)
            counters = read_connector_stats(stats["B"])
            results["formats"][fmt] = {"miss": miss, "hit": hit,
                                       "hit_tokens": counters["maru_lookup_hit_tokens_total"],
                                       "load_bytes": counters["maru_load_bytes_total"]}
            for n in "AB":
                engine[n].close()
    _report(results, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=2)
    return 0


def _measure(engine: EngineProcess, args: argparse.Namespace, seed_base: int) -> dict[int, dict]:
    """TTFT and outputs per prompt size; prompts run one at a time."""
    # A fresh engine's first request pays one-off set-up costs: keep them out.
    engine.generate([random_tokens(args.chunk_tokens // 2, seed=987_654 + seed_base)], max_tokens=1)
    out = {}
    for size in args.sizes:
        prompts = [random_tokens(size, seed=seed_base + size * 100 + i) for i in range(args.repeats)]
        runs = engine.generate(prompts, max_tokens=4)
        out[size] = {"ttft_s": [r.ttft_s for r in runs], "tokens": [r.token_ids for r in runs]}
    return out


def _report(results: dict, args: argparse.Namespace) -> None:
    cpu = _cpu_name()
    print(f"\nmachine: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}")
    print("| prompt tokens | format | recompute (no connector) | miss + store | hit | speed-up vs recompute | outputs equal |")
    print("|---:|---|---:|---:|---:|---:|---|")
    rec = results["recompute"]
    for fmt, data in results["formats"].items():
        for size in results["sizes"]:
            r = statistics.median(rec[size]["ttft_s"])
            m = statistics.median(data["miss"][size]["ttft_s"])
            h = statistics.median(data["hit"][size]["ttft_s"])
            equal = data["hit"][size]["tokens"] == rec[size]["tokens"] == data["miss"][size]["tokens"]
            print(f"| {size} | {fmt} | {r * 1e3:.1f} ms | {m * 1e3:.1f} ms | {h * 1e3:.1f} ms | {r / h:.1f}× | {equal} |")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
