"""What block aliases add to a lookup: a long hit's lookup with and without
the alias query, on the scheduler half's real path.

A writer's prompt is stored (its chunk keys committed in a real index
process, their block aliases registered, as a worker does); then fresh
requests of a prompt that shares it through a block inside its last chunk
are looked up by ``MaruSchedulerHalf.get_num_new_matched_tokens``, in
alternating pairs: aliases on (the lookup matches the whole chunks, then
asks ``match_alias`` for the chunk it missed and finds the writer's) and
off (whole chunks only). Reported: the lookup's wall time from the
request's arrival to its answer (median, p90), and the hit tokens each
gets. GPU geometry by default (vLLM's block 16, chunk 256: 15 aliases per
chunk), chunkwise and layerwise (32 layers).

    PYTHONPATH=core:connector:tools .venv/bin/python bench/alias_lookup_cost.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from maru_core.index.client import IndexClient
from maru_core.keys import KeyNamespace, packed_layer_keys, split_keys
from maru_core.pool import Pool, SlotHeader
from maru_core.pool.slots import SlotFormat
from maru_tools.index_process import IndexProcess
from maru_tools.workload import random_tokens
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from maru_connector.config import parse_config
from maru_connector.lookup import LookupService
from maru_connector.scheduler import MaruSchedulerHalf


def _half(index: IndexProcess, fmt: str, block: int, chunk: int, layers: int) -> MaruSchedulerHalf:
    cfg = parse_config({"maru_index_url": index.url, "maru_pool_path": index.pool_path, "maru_token": index.token,
                        "maru_kv_chunk_tokens": chunk, "maru_format": fmt}, block)
    ns = KeyNamespace(model="bench", dtype="bfloat16", kv_dtype="auto", layout="bench", block_size=block,
                      chunk_tokens=chunk, fmt=cfg.fmt_name)
    lookup = LookupService(lambda: IndexClient(index.url, token=index.token, client_name="bench"),
                           timeout_s=1.0)
    return MaruSchedulerHalf(cfg, (ns,), block, lookup, num_layers=layers, partial_chunk_loads=True,
                             block_alias_loads=True)


def _store(index: IndexProcess, half: MaruSchedulerHalf, prompt: list[int], layered: bool, layers: int) -> None:
    """The writer's chunks committed and their aliases registered."""
    state = half._state(Request("writer", prompt, SamplingParams(max_tokens=1), None))
    keys = state.keys
    chunk_keys = list(keys.by_rank[0])
    objects = split_keys(packed_layer_keys(chunk_keys, range(layers))) if layered else chunk_keys
    most = half._blocks_per_chunk - 1
    aliases = [(a, chunk_keys[c]) for c in range(len(chunk_keys))
               for a in split_keys(b"".join(keys.block_aliases(0, c, most)))]
    half._reqs.clear()
    fmt = SlotFormat.LAYERWISE if layered else SlotFormat.CHUNKWISE
    with IndexClient(index.url, token=index.token, client_name="writer") as client, \
            Pool.attach(index.pool_path) as pool:  # fmt: skip
        for start in range(0, len(objects), 1024):
            batch = objects[start:start + 1024]
            slots = list(client.reserve([(k, 64) for k in batch]))
            for k, slot in zip(batch, slots):
                pool.write_slot_header(slot.offset, SlotHeader(k, slot.generation, 64, fmt=fmt, layout=1))
            assert all(client.commit(batch))
        client.put_aliases(aliases)


def _lookup_ms(half: MaruSchedulerHalf, prompt: list[int], req_id: str) -> tuple[float, int]:
    request = Request(req_id, prompt, SamplingParams(max_tokens=1), None)
    start = time.perf_counter()
    matched, _ = half.get_num_new_matched_tokens(request, 0)
    elapsed = (time.perf_counter() - start) * 1e3
    half.request_finished(request, [])
    assert matched is not None, "the lookup did not answer within its timeout"
    return elapsed, matched


def _measure(args: argparse.Namespace, index: IndexProcess, fmt: str) -> dict:
    layered = fmt == "layerwise"
    half = _half(index, fmt, args.block, args.chunk, args.layers)
    stored = random_tokens(args.tokens + args.chunk, seed=hash(fmt) % 1000)
    _store(index, half, stored, layered, args.layers)
    shared = args.tokens + args.tail_blocks * args.block  # whole chunks, then blocks of the next
    prompt = stored[:shared + 3] + random_tokens(args.chunk, seed=7)
    times: dict[str, list[float]] = {"aliases": [], "whole_chunks": []}
    hits: dict[str, int] = {}
    for i in range(args.warmup + args.pairs):
        for mode in (("aliases", "whole_chunks") if i % 2 else ("whole_chunks", "aliases")):
            half._load_aliases = mode == "aliases"
            elapsed, hits[mode] = _lookup_ms(half, prompt, f"{mode}-{i}")
            if i >= args.warmup:
                times[mode].append(elapsed)
        if (i + 1) % 100 == 0:
            print(f"{fmt}: {i + 1}/{args.warmup + args.pairs} pairs", file=sys.stderr)
    half.shutdown()
    out = {}
    for mode, samples in times.items():
        samples.sort()
        out[mode] = {"hit_tokens": hits[mode], "median_ms": statistics.median(samples),
                     "p90_ms": samples[int(0.9 * len(samples))], "samples": len(samples)}
    out["added_median_ms"] = out["aliases"]["median_ms"] - out["whole_chunks"]["median_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=4096, help="whole chunks shared (tokens)")
    p.add_argument("--tail-blocks", type=int, default=10, help="blocks of the next chunk shared")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    result = {"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(),
              "load": os.getloadavg()}
    with IndexProcess(pool_size="256Mi", extra_args=("--page-size", "4Ki")) as index:
        for fmt in ("chunkwise", "layerwise"):
            result[fmt] = r = _measure(args, index, fmt)
            print(f"{fmt}: aliases {r['aliases']['hit_tokens']} tokens, lookup median "
                  f"{r['aliases']['median_ms']:.3f} ms (p90 {r['aliases']['p90_ms']:.3f}); whole chunks "
                  f"{r['whole_chunks']['hit_tokens']} tokens, {r['whole_chunks']['median_ms']:.3f} ms "
                  f"(p90 {r['whole_chunks']['p90_ms']:.3f}); added {r['added_median_ms']:+.3f} ms")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
