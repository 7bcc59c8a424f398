"""Async + overlapped hits against sync hits on ONE vLLM CPU engine, in pairs.

    .venv/bin/python bench/ttft_paired.py [--sizes 1024 4096] [--pairs 10]
        [--mp off on] [--formats chunkwise layerwise] [--partial 2048] [--partial-new N]
        [--misses N] [--miss-tokens 2065]

``bench/ttft_async.py`` serves each load mode from its own engine process;
on a 2-core machine two processes of the same code differ by more than the
5 % its targets allow. Here one engine (async load, overlap, async store)
serves every mode, picked per request with ``kv_transfer_params``
(``maru_load``, see ``maru_connector.request_params``):

- ``sync``: loaded in the step that computes it, forward after the load
  (what an engine started with ``maru_async_load=false`` does);
- ``auto``: no ``maru_load``, the engine's own choice as shipped (async +
  overlap: a lone hit loads in its step, beside its forward);
- ``park``: loaded while parked, then computed in the next step.

Full hits: the same prompt in all three modes, one request at a time, the
order rotating from pair to pair (vLLM's prefix cache is off, so each
serving loads from the pool). Partial hits: a stored prefix of ``--partial``
tokens plus ``--partial-new`` new tokens (as many as cached by default),
new ones per mode (the engine stores what it computes). A writer engine
stores the prompts first; an engine without the connector computes them,
and every full hit's token must equal its.
Misses (``--misses``): fresh prompts of ``--miss-tokens``, in pairs of one
that stores (as the engine is configured: async store) and one that asks not
to be (``maru_store`` false), both looked up and missed: what storing costs
a miss, on the same engine.
Reports medians and, per pair, the ratio to the sync hit (to the miss that
does not store): its median with a bootstrap 95 % interval, and in how many
pairs the mode was faster. Under load: rounds of 4 hits and 4 fresh misses submitted at once, the hits in
each mode in turn; the hits' and the misses' TTFT p50 / p99 per mode.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack

from maru_connector.config import make_kv_transfer_config
from maru_tools.engine import EngineProcess, EngineSpec
from maru_tools.index_process import IndexProcess, unique_pool_path
from maru_tools.stats_reader import read_connector_stats
from maru_tools.workload import random_tokens

from ttft_async import FORMATS, _engine_env, _warm, run

MODES = {"sync": {"maru_load": "sync"}, "auto": None, "park": {"maru_load": "park"}}
STORE_MODES = {"store": None, "skip": {"maru_store": False}}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--pairs", type=int, default=10, help="prompts per size, each served in every mode")
    p.add_argument("--partial", type=int, default=2048, help="cached tokens of the partial hits (0: none)")
    p.add_argument("--partial-new", type=int, default=None,
                   help="new tokens of the partial hits (default: as many as cached)")
    p.add_argument("--misses", type=int, default=0, help="pairs of misses, stored and not (0: none)")
    p.add_argument("--miss-tokens", type=int, default=2065)
    p.add_argument("--busy-rounds", type=int, default=4,
                   help="rounds of 8 requests at once (4 hits, 4 misses) per mode (0: none)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--mp", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--release-after", type=int, default=1, help="maru_overlap_release_after_layers")
    p.add_argument("--settle-s", type=float, default=1.2,
                   help="pause before each measured request (see bench/ttft_async.py)")
    p.add_argument("--no-prefault", action="store_true",
                   help="maru_prefault_pool off: the pool's pages fault in as they are touched")
    p.add_argument("--reserve-cpus", type=int, default=0,
                   help="cores left out of the forward's OpenMP team for the copies "
                        "(vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU; 0: all cores in the team)")
    p.add_argument("--copy-priority", choices=["normal", "idle"], default="idle",
                   help="the copy threads' priority (maru_copy_priority)")
    p.add_argument("--trace", default=None, help="append per-phase timestamps to this file")
    p.add_argument("--json", default=os.path.join("out", "ttft_paired.json"))
    args = p.parse_args()
    if args.partial_new is None:
        args.partial_new = args.partial
    return args


def _longest(args) -> int:
    return max(args.sizes + [args.partial + args.partial_new, args.miss_tokens if args.misses else 0])


def _workload(args) -> dict[str, list[list[int]]]:
    w = {f"full-{n}": [random_tokens(n, seed=11_000_000 + 100 * n + i) for i in range(args.pairs)]
         for n in args.sizes}
    if args.partial:
        w["partial-prefix"] = [random_tokens(args.partial, seed=12_000_000 + i) for i in range(args.pairs)]
    return w


def _one(engine: EngineProcess, prompt: list[int], settle_s: float, params=None):
    time.sleep(settle_s)
    (result,) = engine.generate([prompt], max_tokens=1, kv_transfer_params=params)
    return result


def _serve_pairs(engine, prompts_by_mode: dict[str, list[list[int]]], settle_s: float, progress: str,
                 params: dict = MODES) -> dict:
    """Pair i: every mode's prompt i, in an order rotating with i (`params`: each mode's
    kv_transfer_params)."""
    names = list(prompts_by_mode)
    out = {name: {"ttft_s": [], "tokens": []} for name in names}
    pairs = len(next(iter(prompts_by_mode.values())))
    for i in range(pairs):
        for name in names[i % len(names):] + names[: i % len(names)]:
            r = _one(engine, prompts_by_mode[name][i], settle_s, params[name])
            out[name]["ttft_s"].append(r.ttft_s)
            out[name]["tokens"].append(r.token_ids)
        print(f"  {progress}: pair {i + 1}/{pairs}", file=sys.stderr, flush=True)
    return out


def _serve_busy(engine, hit_prompts: list[list[int]], args, progress: str) -> dict:
    """Rounds of the hits and as many fresh misses at once, the hits in each
    mode in turn: the TTFTs of the hits and of the misses, per mode."""
    out = {name: {"hits_s": [], "misses_s": []} for name in MODES}
    size = len(hit_prompts[0])
    for r in range(args.busy_rounds):
        names = list(MODES)
        for m, name in enumerate(names[r % len(names):] + names[: r % len(names)]):
            misses = [random_tokens(size, seed=14_000_000 + 10_000 * r + 100 * m + i) for i in range(len(hit_prompts))]
            time.sleep(args.settle_s)
            runs = engine.generate(hit_prompts + misses, max_tokens=1, concurrent=True,
                                   kv_transfer_params=MODES[name])
            out[name]["hits_s"] += [x.ttft_s for x in runs[: len(hit_prompts)]]
            out[name]["misses_s"] += [x.ttft_s for x in runs[len(hit_prompts):]]
        print(f"  {progress} busy: round {r + 1}/{args.busy_rounds}", file=sys.stderr, flush=True)
    return out


def _run_mode(args, mp: bool, model_dir: str, workdir: str, out: dict) -> None:
    w = _workload(args)
    longest = _longest(args)
    base = EngineSpec(model_dir=model_dir, block_size=args.block_size, max_model_len=longest + 128,
                      max_num_batched_tokens=longest + 128, multiprocessing=mp, env=_engine_env(args, mp))
    mode = "mp-on" if mp else "mp-off"
    res = out.setdefault(mode, {})
    with ExitStack() as stack:
        index = IndexProcess(unique_pool_path("marucache-bench"), pool_size="2Gi", log_dir=workdir)
        stack.callback(index.close)
        index.start()
        ref = stack.enter_context(EngineProcess(base, os.path.join(workdir, f"{mode}-R.log")))
        _warm(ref, args)
        reference = {key: [r.token_ids for r in ref.generate(ps, max_tokens=1)]
                     for key, ps in w.items() if key.startswith("full-")}
        for f, fmt in enumerate(args.formats):
            knobs = dict(kv_chunk_tokens=args.chunk_tokens, use_layerwise=FORMATS[fmt], async_store=True,
                         lookup_timeout_s=1.0, pool_path=index.pool_path, token=index.token,
                         prefault_pool=not args.no_prefault, copy_priority=args.copy_priority)
            writer = EngineProcess(EngineSpec(**{**base.__dict__, "kv_transfer_config": make_kv_transfer_config(
                index.url, **knobs)}), os.path.join(workdir, f"{mode}-{fmt}-W.log"), wait=False)
            stack.callback(writer.close)
            stats_dir = tempfile.mkdtemp(prefix=f"{mode}-{fmt}-H-stats-", dir=workdir)
            hits = EngineProcess(EngineSpec(**{**base.__dict__, "kv_transfer_config": make_kv_transfer_config(
                index.url, async_load=True, overlap_load_with_compute=True, stats_dir=stats_dir,
                overlap_release_after_layers=args.release_after, **knobs)}),
                os.path.join(workdir, f"{mode}-{fmt}-H.log"), wait=False)
            stack.callback(hits.close)
            for engine in (writer, hits):
                engine.wait_ready()
                _warm(engine, args)
            for prompts in w.values():
                writer.generate(prompts, max_tokens=1)
            _warm(writer, args)  # one more step: the verdict on the last prompt's stores
            time.sleep(1.0)  # the last stores commit
            writer.close()
            data = res[fmt] = {"loadavg": [os.getloadavg()[0]]}
            before = read_connector_stats(stats_dir)
            for n in args.sizes:
                key = f"full-{n}"
                data[key] = _serve_pairs(hits, {name: w[key] for name in MODES}, args.settle_s,
                                         f"{mode} {fmt} {key}")
                data[key]["tokens_equal"] = all(data[key][name]["tokens"] == reference[key] for name in MODES)
            if args.partial:
                partial = {name: [p + random_tokens(args.partial_new, seed=13_000_000 + 1000 * m + i)
                                  for i, p in enumerate(w["partial-prefix"])] for m, name in enumerate(MODES)}
                data["partial"] = _serve_pairs(hits, partial, args.settle_s, f"{mode} {fmt} partial")
            if args.misses:
                fresh = {name: [random_tokens(args.miss_tokens, seed=16_000_000 + 100_000 * f + 1000 * m + i)
                                for i in range(args.misses)] for m, name in enumerate(STORE_MODES)}
                data["miss"] = _serve_pairs(hits, fresh, args.settle_s, f"{mode} {fmt} miss", STORE_MODES)
            if args.busy_rounds:
                data["busy"] = _serve_busy(hits, w[f"full-{min(args.sizes)}"][:4], args, f"{mode} {fmt}")
            data["loadavg"].append(os.getloadavg()[0])
            after = read_connector_stats(stats_dir)
            # Every serving must have hit: a full hit of n tokens loads n - 1 (vLLM computes one).
            expected = len(MODES) * (args.pairs * (sum(n - 1 for n in args.sizes) + args.partial)
                                     + args.busy_rounds * 4 * (min(args.sizes) - 1))
            hit = after["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"]
            failed = sum(v for k, v in after.items() if k.startswith("maru_load_failures"))
            data["hit_tokens"], data["hit_tokens_expected"], data["load_failures"] = hit, expected, failed
            data["store_bytes"] = after["maru_store_bytes_total"] - before["maru_store_bytes_total"]
            if hit != expected or failed:
                print(f"WARNING {mode} {fmt}: {hit:.0f} hit tokens of {expected} expected, "
                      f"{failed:.0f} failed loads", file=sys.stderr)
            hits.close()


def _bootstrap_median(xs: list[float], rounds: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def _paired_ratio(times: list[float], base: list[float]) -> dict:
    """Each pair's time over its base: median, 95 % interval, pairs faster."""
    ratios = [x / s for x, s in zip(times, base)]
    return {"ratio": statistics.median(ratios), "ci95": _bootstrap_median(ratios),
            "faster": sum(r < 1 for r in ratios), "pairs": len(ratios)}


def _medians_ms(served: dict) -> dict:
    return {f"{name}_ms": statistics.median(s["ttft_s"]) * 1e3 for name, s in served.items()}


def summarise(served: dict) -> dict:
    """Medians per mode; per-pair ratios to sync: median, 95 % interval, pairs faster."""
    row = _medians_ms({name: served[name] for name in MODES})
    for name in ("auto", "park"):
        row[name] = _paired_ratio(served[name]["ttft_s"], served["sync"]["ttft_s"])
    return row


def summarise_store(served: dict) -> dict:
    """Misses: medians of the stored and the unstored; per pair, stored over unstored."""
    return {**_medians_ms({name: served[name] for name in STORE_MODES}),
            **_paired_ratio(served["store"]["ttft_s"], served["skip"]["ttft_s"])}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] * 1e3


def _report(out: dict) -> None:
    print("| engine | format | hit | sync | async as shipped | × sync (95 % CI), pairs faster "
          "| parked | × sync (95 % CI), pairs faster | tokens equal |")
    print("|---|---|---|---:|---:|---|---:|---|---|")
    for mode, formats in out.items():
        for fmt, data in formats.items():
            for key, served in data.items():
                if not (key.startswith("full-") or key == "partial"):
                    continue
                row = summarise(served)
                cells = [f"{row[n]['ratio']:.3f} ({row[n]['ci95'][0]:.3f}–{row[n]['ci95'][1]:.3f}), "
                         f"{row[n]['faster']}/{row[n]['pairs']}" for n in ("auto", "park")]
                equal = served.get("tokens_equal", "–")
                print(f"| {mode} | {fmt} | {key} | {row['sync_ms']:.1f} | {row['auto_ms']:.1f} | {cells[0]} "
                      f"| {row['park_ms']:.1f} | {cells[1]} | {equal} |")
            if "miss" in data:
                row = summarise_store(data["miss"])
                print(f"| {mode} | {fmt} | miss, not stored / stored | {row['skip_ms']:.1f} | {row['store_ms']:.1f} "
                      f"| {row['ratio']:.3f} ({row['ci95'][0]:.3f}–{row['ci95'][1]:.3f}), "
                      f"{row['faster']}/{row['pairs']} | | | |")
            if "busy" in data:
                for name in MODES:
                    b = data["busy"][name]
                    print(f"| {mode} | {fmt} | busy, hits {name} | hits p50/p99 {_pct(b['hits_s'], .5):.1f}/"
                          f"{_pct(b['hits_s'], .99):.1f} ms | misses p50/p99 {_pct(b['misses_s'], .5):.1f}/"
                          f"{_pct(b['misses_s'], .99):.1f} ms |")
            print(f"| {mode} | {fmt} | load average {', '.join(f'{x:.1f}' for x in data['loadavg'])}; "
                  f"hit tokens {data['hit_tokens']:.0f} of {data['hit_tokens_expected']}, "
                  f"failed loads {data['load_failures']:.0f}, stored {data.get('store_bytes', 0) / 2**20:.1f} MiB |")


def main() -> int:
    args = _parse()
    return run(args, _longest(args), _run_mode, _report)


if __name__ == "__main__":
    sys.exit(main())
