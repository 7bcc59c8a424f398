"""TTFT of hits served by async + overlapped loads against synchronous loads,
of misses that store against an engine without the connector, and of mixed
hits and misses under load, on the vLLM CPU engine.

    .venv/bin/python bench/ttft_async.py [--sizes 1024 4096 16384] [--repeats 5]
        [--mp off on] [--formats chunkwise layerwise] [--trace out/trace.jsonl]

Per multiprocessing mode: engine R (no connector) computes every prompt;
engine A (async load, async store) serves the same prompts as misses and
stores them; engines S (sync load), O (async load + overlap, the default
choice: a lone hit loads in its own step) and P (the same, parking every
hit: ``maru_park_lone_hits``) then serve them as full hits, as partial hits
(a stored prefix of half the prompt plus as many new tokens), and as 8
concurrent requests (4 hits, 4 misses; three rounds, engines in turn).
Engines serving the same kind of request alternate prompt by prompt (R and
A; S, O and P), so every column sees the same load on a shared machine;
each engine stores the new half of its partial hits, so each gets new
tokens of its own behind the same prefix. Every full hit's tokens are
compared with R's. Model: the float32 tiny Llama (2 layers, hidden 256),
block size 128, 256-token chunks. Prints Markdown tables (medians) and
writes the raw figures as JSON. With --trace, every engine process appends
per-phase timestamps (bench/trace) to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack

from maru_connector.config import make_kv_transfer_config
from maru_tools.engine import EngineProcess, EngineSpec
from maru_tools.index_process import IndexProcess, unique_pool_path
from maru_tools.tiny_model import TinyModelSpec, build_tiny_model
from maru_tools.workload import random_tokens

FORMATS = {"chunkwise": False, "layerwise": True}
ENGINES = {"A": dict(async_load=True, overlap_load_with_compute=True),
           "S": dict(async_load=False, overlap_load_with_compute=False),
           "O": dict(async_load=True, overlap_load_with_compute=True),
           "P": dict(async_load=True, park_lone_hits=True, overlap_load_with_compute=True)}
HITS = ("S", "O", "P")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--mp", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--partial", type=int, default=2048, help="cached tokens of the partial hits (0: none)")
    p.add_argument("--concurrent", type=int, default=8, help="requests at once, half hits (0: none)")
    p.add_argument("--busy-repeats", type=int, default=3, help="rounds of the concurrent requests per engine")
    p.add_argument("--release-after", type=int, default=1,
                   help="maru_overlap_release_after_layers of the async + overlap engines")
    p.add_argument("--settle-s", type=float, default=1.2,
                   help="pause before each measured request: vLLM's shared-memory queue readers "
                        "busy-loop for 1 s after each read, so with multiprocessing the engine that "
                        "served the last request would still take cores from the next one")
    p.add_argument("--reserve-cpus", type=int, default=0,
                   help="cores left out of the forward's OpenMP team for the copies "
                        "(vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU; 0: all cores in the team)")
    p.add_argument("--trace", default=None, help="append per-phase timestamps to this file")
    p.add_argument("--json", default=os.path.join("out", "ttft_async.json"))
    return p.parse_args()


def _prompts(args, size: int, tag: int) -> list[list[int]]:
    return [random_tokens(size, seed=tag * 1_000_000 + size * 100 + i) for i in range(args.repeats)]


def _workload(args) -> dict[str, list[list[int]]]:
    """Named prompt lists; ``stored`` ones are served by A first (misses)."""
    w = {f"full-{n}": _prompts(args, n, 1) for n in args.sizes}
    if args.partial:
        w["partial-prefix"] = _prompts(args, args.partial, 2)
        fresh = _prompts(args, args.partial, 3)
        w["partial"] = [p + f for p, f in zip(w["partial-prefix"], fresh)]
    if args.concurrent:
        half = args.concurrent // 2
        n = min(args.sizes)
        w["busy-hits"] = [random_tokens(n, seed=4_000_000 + i) for i in range(half)]
        w["busy-misses"] = [random_tokens(n, seed=5_000_000 + i) for i in range(args.concurrent - half)]
    return w


def _ttfts(engine: EngineProcess, prompts, concurrent=False, settle_s: float = 0.0) -> dict:
    time.sleep(settle_s)
    runs = engine.generate(prompts, max_tokens=1, concurrent=concurrent)
    return {"ttft_s": [r.ttft_s for r in runs], "tokens": [r.token_ids for r in runs]}


def _alternating(engines: dict[str, EngineProcess], prompts: dict[str, list], settle_s: float) -> dict[str, dict]:
    """Each engine serves its prompt i in turn, one request at a time: on a
    shared machine every column then sees the same load."""
    out = {name: {"ttft_s": [], "tokens": []} for name in engines}
    for i in range(len(next(iter(prompts.values())))):
        for name, engine in engines.items():
            one = _ttfts(engine, [prompts[name][i]], settle_s=settle_s)
            for k in out[name]:
                out[name][k] += one[k]
    return out


def _warm(engine: EngineProcess, args) -> None:
    engine.generate([random_tokens(args.chunk_tokens // 2, seed=987_654)], max_tokens=1)


def _reserved_cpus_env(reserved: int, mp: bool) -> dict[str, str]:
    """Leave the last ``reserved`` cores out of the forward's OpenMP team, as
    vLLM's CPU worker does with ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (it reserves
    one core for the scheduler and one for KV transfer when it has enough;
    on 2 cores it reserves none). With multiprocessing off vLLM binds
    nothing, so the same binding is set here; the connector's copy threads
    then run on the reserved cores (``maru_copy_cpus`` auto)."""
    if reserved <= 0:
        return {}
    if mp:  # vLLM's own binding (the test engines' default is none)
        return {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved), "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    team = sorted(os.sched_getaffinity(0))[:-reserved]
    if not team:
        raise SystemExit(f"--reserve-cpus {reserved} leaves no core for the forward")
    return {"OMP_NUM_THREADS": str(len(team)), "OMP_PROC_BIND": "true",
            "OMP_PLACES": "{" + ",".join(map(str, team)) + "}"}


def _engine_env(args, mp: bool) -> dict[str, str]:
    # Passive OpenMP waits, for every engine alike: on a shared machine a
    # spinning OpenMP thread mostly burns the core another engine's (or
    # its own team's) thread needs. The spin also once made the engine
    # without a connector 2-3x slower than the ones with it: libgomp
    # throttles it only in processes that run more OpenMP threads than there
    # are cores, which the connector's torch copies (a team per copy thread)
    # brought about; its copies no longer use OpenMP.
    env = {"OMP_NUM_THREADS": str(os.cpu_count() or 1), "OMP_WAIT_POLICY": "PASSIVE"}
    env.update(_reserved_cpus_env(args.reserve_cpus, mp))
    if args.trace:
        env["MARU_TRACE_FILE"] = os.path.abspath(args.trace)
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace")
        env["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def _run_mode(args, mp: bool, model_dir: str, workdir: str, out: dict) -> None:
    w = _workload(args)
    longest = max(len(p) for ps in w.values() for p in ps)
    base = EngineSpec(model_dir=model_dir, block_size=args.block_size, max_model_len=longest + 128,
                      max_num_batched_tokens=longest + 128, multiprocessing=mp, env=_engine_env(args, mp))
    mode = "mp-on" if mp else "mp-off"
    res = out.setdefault(mode, {"formats": {}})
    with ExitStack() as stack:
        index = IndexProcess(unique_pool_path("marucache-bench"), pool_size="2Gi", log_dir=workdir)
        stack.callback(index.close)
        index.start()
        ref = EngineProcess(base, os.path.join(workdir, f"{mode}-R.log"))
        stack.callback(ref.close)
        _warm(ref, args)
        for fmt in args.formats:
            data = res["formats"][fmt] = {"loadavg": []}
            engines = {}
            for name, knobs in ENGINES.items():
                config = make_kv_transfer_config(
                    index.url, pool_path=index.pool_path, token=index.token,
                    kv_chunk_tokens=args.chunk_tokens, use_layerwise=FORMATS[fmt],
                    async_store=True, lookup_timeout_s=1.0, **knobs,
                    **({"overlap_release_after_layers": args.release_after}
                       if knobs["overlap_load_with_compute"] else {}))
                engines[name] = EngineProcess(EngineSpec(**{**base.__dict__, "kv_transfer_config": config}),
                                              os.path.join(workdir, f"{mode}-{fmt}-{name}.log"), wait=False)
                stack.callback(engines[name].close)
            for engine in engines.values():
                engine.wait_ready()
                _warm(engine, args)
            data["loadavg"].append(os.getloadavg()[0])
            stored = [k for k in w if k.startswith("full-") or k in ("partial-prefix", "busy-hits")]
            data["miss"] = {}
            for key in stored:
                both = _alternating({"R": ref, "A": engines["A"]}, {"R": w[key], "A": w[key]}, args.settle_s)
                data["miss"][key], data.setdefault("recompute", {})[key] = both["A"], both["R"]
            # One more step delivers the verdict on the last prompt's stores;
            # without it the last prompt of the list would stay a miss.
            _warm(engines["A"], args)
            time.sleep(1.0)  # the last stores commit
            data["loadavg"].append(os.getloadavg()[0])
            hits = {name: engines[name] for name in HITS}
            for name in HITS:
                data[name] = {}
            for key in [k for k in w if k.startswith("full-")]:
                served = _alternating(hits, {name: w[key] for name in HITS}, args.settle_s)
                for name in HITS:
                    data[name][key] = served[name]
            if args.partial:
                # Each engine stores what it computes: each gets new tokens of
                # its own behind the same cached prefix.
                partial = {name: [p[: args.partial] + random_tokens(args.partial, seed=7_000_000 + 1000 * n + i)
                                  for i, p in enumerate(w["partial"])] for n, name in enumerate(HITS)}
                partial["S"] = w["partial"]
                served = _alternating(hits, partial, args.settle_s)
                for name in HITS:
                    data[name]["partial"] = served[name]
            if args.concurrent:
                for name in hits:
                    data[name]["busy"] = {"hits_s": [], "misses_s": []}
                for rep in range(args.busy_repeats):  # engines in turn, as for single prompts
                    for n, name in enumerate(hits):
                        # Fresh misses each time: a miss's store must not turn the next run into hits.
                        misses = [random_tokens(len(p), seed=6_000_000 + 100_000 * rep + 1000 * n + i)
                                  for i, p in enumerate(w["busy-misses"])]
                        t = _ttfts(engines[name], w["busy-hits"] + misses, concurrent=True,
                                   settle_s=args.settle_s)["ttft_s"]
                        data[name]["busy"]["hits_s"] += t[: len(w["busy-hits"])]
                        data[name]["busy"]["misses_s"] += t[len(w["busy-hits"]):]
            data["loadavg"].append(os.getloadavg()[0])
            for engine in engines.values():
                engine.close()


def _ms(xs) -> str:
    return f"{statistics.median(xs) * 1e3:.1f}"


def _pct(xs, q) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _report(out: dict) -> None:
    for mode, res in out.items():
        print(f"\n### {mode}")
        print("| prompt | format | recompute | miss + store | × recompute | sync hit | async+overlap hit | × sync "
              "| parking every hit | × sync | tokens equal |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for fmt, data in res["formats"].items():
            rec = data["recompute"]
            print(f"| load average {fmt} | {', '.join(f'{x:.1f}' for x in data['loadavg'])} |")
            for key in [k for k in data["S"] if k != "busy"]:
                s, o, p = (data[name][key]["ttft_s"] for name in HITS)
                r = rec[key]["ttft_s"] if key in rec else None
                miss = data["miss"].get(key)
                m = _ms(miss["ttft_s"]) if miss else "–"
                mr = f"{statistics.median(miss['ttft_s']) / statistics.median(r):.2f}" if miss else "–"
                equal = "–" if key == "partial" else all(rec[key]["tokens"] == data[name][key]["tokens"]
                                                         for name in HITS)
                r = _ms(r) if r else "–"
                ratio_o, ratio_p = (statistics.median(x) / statistics.median(s) for x in (o, p))
                print(f"| {key} | {fmt} | {r} | {m} | {mr} | {_ms(s)} | {_ms(o)} | {ratio_o:.2f} "
                      f"| {_ms(p)} | {ratio_p:.2f} | {equal} |")
            if "busy" in data["S"]:
                for name, label in (("S", "sync"), ("O", "async+overlap"), ("P", "parking every hit")):
                    hits, misses = data[name]["busy"]["hits_s"], data[name]["busy"]["misses_s"]
                    print(f"| busy {fmt} {label} | hits p50/p99 {_pct(hits, .5) * 1e3:.1f}/{_pct(hits, .99) * 1e3:.1f} ms"
                          f" | misses p50/p99 {_pct(misses, .5) * 1e3:.1f}/{_pct(misses, .99) * 1e3:.1f} ms |")


def run(args, longest: int, run_mode, report) -> int:
    """Build the tiny model for prompts of up to ``longest`` tokens, call
    ``run_mode`` for each multiprocessing mode, print ``report`` of what it
    measured and write the raw figures to ``args.json``."""
    workdir = tempfile.mkdtemp(prefix="marucache-bench-")
    spec = TinyModelSpec(max_position_embeddings=max(8192, 2 * longest + 256))
    model_dir = str(build_tiny_model(spec))
    out: dict = {}
    for mp in args.mp:
        run_mode(args, mp == "on", model_dir, workdir, out)
    report(out)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump({"args": vars(args), "results": out}, fh)
    print(f"\nlogs: {workdir}; raw: {args.json}")
    return 0


def main() -> int:
    args = _parse()
    return run(args, max(args.sizes + [args.partial]), _run_mode, _report)


if __name__ == "__main__":
    sys.exit(main())
