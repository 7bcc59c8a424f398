"""TTFT of fresh misses on engines with and without the connector, served
alternately prompt by prompt, each with its own environment.

    .venv/bin/python bench/miss_baseline.py R,A [TOKENS] [REPEATS] [VAR=VALUE ...]

Engine names: ``R...`` runs without a connector, ``A...`` with it (async load
with overlap, async store). ``NAME:VAR=VALUE`` gives one engine an
environment variable of its own; trailing ``VAR=VALUE`` arguments go to
every engine. E.g. ``R,R:GOMP_SPINCOUNT=1000,A`` compares an engine without
the connector, the same with libgomp's throttled spin, and one with the
connector. Prints per-engine medians and every TTFT in ms.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from contextlib import ExitStack

from maru_connector.config import make_kv_transfer_config
from maru_tools.engine import EngineProcess, EngineSpec
from maru_tools.index_process import IndexProcess, unique_pool_path
from maru_tools.tiny_model import TinyModelSpec, build_tiny_model
from maru_tools.workload import random_tokens


def _config(name: str, index: IndexProcess):
    if not name.startswith("A"):
        return None
    return make_kv_transfer_config(index.url, pool_path=index.pool_path, token=index.token,
                                   kv_chunk_tokens=256, async_store=True, lookup_timeout_s=1.0,
                                   async_load=True, overlap_load_with_compute=True)


def main() -> int:
    names = sys.argv[1].split(",")
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    common = {"OMP_NUM_THREADS": str(os.cpu_count() or 1), **dict(a.split("=", 1) for a in sys.argv[4:])}
    workdir = tempfile.mkdtemp(prefix="marucache-miss-")
    model_dir = str(build_tiny_model(TinyModelSpec(max_position_embeddings=8448)))
    base = EngineSpec(model_dir=model_dir, block_size=128, max_model_len=4224, max_num_batched_tokens=4224)
    with ExitStack() as stack:
        index = IndexProcess(unique_pool_path("marucache-miss"), pool_size="2Gi", log_dir=workdir)
        stack.callback(index.close)
        index.start()
        engines = {}
        for n, name in enumerate(names):
            own = dict(kv.split("=", 1) for kv in name.split(":")[1:])
            spec = EngineSpec(**{**base.__dict__, "kv_transfer_config": _config(name, index),
                                 "env": {**common, **own}})
            engines[name] = EngineProcess(spec, os.path.join(workdir, f"engine-{n}.log"), wait=False)
            stack.callback(engines[name].close)
        for engine in engines.values():
            engine.wait_ready()
            engine.generate([random_tokens(128, seed=987_654)], max_tokens=1)
        ttfts = {name: [] for name in names}
        for i in range(repeats):
            for n, (name, engine) in enumerate(engines.items()):
                prompt = random_tokens(size, seed=10_000 * i + 100 * n + size)
                ttfts[name].append(engine.generate([prompt], max_tokens=1)[0].ttft_s * 1e3)
        for name in names:
            print(f"{name}: median {statistics.median(ttfts[name]):.1f} ms;",
                  " ".join(f"{x:.1f}" for x in ttfts[name]))
        print("load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
