"""Time to first token of prefix hits with real compute on the GPU.

    PYTHONPATH=connector:core:tests/connector python3 bench/ttft_gpu.py --out DIR
    ... bench/ttft_gpu.py --cpu --out DIR        # tiny sizes on the CPU (CI)

A stand-in for vLLM on one GPU (vLLM's CUDA build needs another torch than
the GPU machine has): a Llama-3-8B stack (``tests/connector/llama_layer.py``:
32 layers of bf16 QKV/O projections, RoPE, flash attention over the paged KV,
SwiGLU MLP) stepped by ``ttft_driver.Engine`` with the connector's real
scheduler and worker halves, a real ``marucache index`` process and its pool
in ``/dev/shm``. For each object format:

1. a writer engine prefills each prompt once and stores it (async store);
   its KV blocks are kept as the reference;
2. the same 16k prefill without the connector and with it, interleaved: the
   store's cost to the prefill, and the time until the objects are committed;
3. a reader engine serves each prompt as a hit in every mode (sync, sync with
   overlap, async, async with overlap; eager and piecewise CUDA graphs);
   before every run the reader's KV cache is filled with random values, after
   it the loaded blocks are compared bit for bit with the reference;
4. load alone (sync load, no forward), compute alone (the forward of the new
   tokens with the prefix in place) and recompute (the whole prompt, chunked
   prefill, no connector);
5. 1, 2, 4, 8 concurrent hits.

Writes ``ttft.json``, prints a Markdown table and plots ``ttft.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "connector")]

import vllm_shim  # noqa: E402  (vLLM's base classes, where vLLM is not installed)

vllm_shim.install()

from llama_layer import LLAMA3_8B, TINY, LlamaStack, fill_random, paged_kv_caches  # noqa: E402
from ttft_driver import Engine, Request  # noqa: E402
from hit_phases import PhaseRecorder, describe, median_phases  # noqa: E402
from ttft_setup import Cluster, MODES  # noqa: E402

GB = 1e9


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="tiny model and sizes on the CPU")
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="cached tokens of full hits (default 4096 16384 32768)")
    p.add_argument("--partial", type=int, nargs=2, default=None, metavar=("CACHED", "NEW"),
                   help="a partial hit (default 16384 2048)")
    p.add_argument("--new-tokens", type=int, default=1, help="uncached tokens of a full hit")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--formats", nargs="+", default=["chunkwise", "layerwise"])
    p.add_argument("--modes", nargs="+", default=None, choices=list(MODES))
    p.add_argument("--concurrency", type=int, nargs="+", default=None)
    p.add_argument("--concurrent-size", type=int, default=None)
    p.add_argument("--store-size", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--out", default=".")
    p.add_argument("--whole-inline-beside-forward", action="store_true",
                   help="experiment: issue a small load whole on the engine thread even when a long "
                        "forward follows (before: always)")
    p.add_argument("--head-only-inline", action="store_true",
                   help="experiment: issue only a load's head on the engine thread, a full hit's too "
                        "(as shipped: only beside a forward of a chunk or more)")
    p.add_argument("--torch-compare", action="store_true",
                   help="A/B: a verified fill's comparison as torch operations after the sum "
                        "kernel (before), not in the same launch")
    p.add_argument("--no-sum-batches", action="store_true",
                   help="A/B: a verified load's fills summed one launch each (before), not in batches "
                        "of layers side by side in staging")
    p.add_argument("--copies-ahead", type=int, default=None,
                   help="A/B: fills whose copies are queued past a fill before it joins those "
                        "waiting for their scatter (the engine's COPIES_AHEAD, 2; 0: before)")
    p.add_argument("--paired", action="store_true",
                   help="the modes (and --arms) of a case served in turn, one hit each per round, "
                        "the order rotated each round: each verified mode's TTFT over its "
                        "_unverified mode's in the same round, so a host's drift between runs "
                        "cancels (medians and quartiles of the per-round ratios)")
    p.add_argument("--arms", nargs="+", default=None, metavar="KNOB=N[,KNOB=N]",
                   help="with --paired: each mode in each arm, an arm being settings of the CUDA "
                        "engine's module knobs made before each of its hits (e.g. COPIES_AHEAD=4 "
                        "HEAD_ONLY_ALWAYS=1; a knob an arm does not set keeps its default)")
    p.add_argument("--triton-launch", action="store_true",
                   help="A/B: the checksum kernel launched through Triton's launcher (before), not "
                        "through the CUDA driver directly")
    p.add_argument("--two-round-trip-pins", action="store_true",
                   help="early pins as an index without retrieve_prefix takes them: a "
                        "match_prefix, then a retrieve")
    p.add_argument("--verify-payload", choices=["on", "off"], default=None,
                   help="maru_verify_payload for every mode that does not set it (its *_unverified "
                        "and *_verify variants do); default: the connector's default (on)")
    p.add_argument("--no-early-pins", action="store_true",
                   help="A/B: the worker retrieves (pins) each load itself instead of copying under "
                        "the pins its lookup took (maru_early_pins=false)")
    p.add_argument("--attention", choices=["varlen", "per-request"], default="varlen",
                   help="A/B: the stand-in's attention as one flash kernel per layer for the "
                        "whole batch (as vLLM runs it) or one per request (before)")
    p.add_argument("--weights", choices=["out-in", "in-out"], default="out-in",
                   help="A/B: the stand-in's projections stored [out, in] and applied by "
                        "F.linear (as vLLM's) or [in, out] by x @ w (before)")
    p.add_argument("--head-start-mib", type=int, default=None,
                   help="A/B: how much of a hit is copied when its lookup answers, before its load "
                        "is submitted (the engine's HEAD_START_BYTES, 64 MiB; 0: none)")
    p.add_argument("--group-below-mib", type=float, default=None,
                   help="experiment: load layers smaller than this in groups (the engine's "
                        "GROUP_BELOW_BYTES, 8 MiB)")
    p.add_argument("--profile", nargs="*", default=[], metavar="CASE/MODE",
                   help="torch-profiler timeline of the last timed hit of these cases and "
                        "modes (e.g. 4096/sync_overlap_graphs): a Chrome trace and a summary")
    p.add_argument("--timeline", nargs="*", default=[], metavar="CASE/MODE",
                   help="host timestamps of each timed hit's phases for these cases and "
                        "modes (no profiler: the hit runs at full speed)")
    args = p.parse_args(argv)
    tiny = args.cpu
    args.sizes = args.sizes or ([256] if tiny else [4096, 16384, 32768])
    # piecewise graphs and stream priorities exist on CUDA only
    args.modes = args.modes or [m for m in MODES if not tiny or not m.endswith(("graphs", "0"))]
    args.concurrency = args.concurrency or ([1, 2] if tiny else [1, 2, 4, 8])
    args.partial = args.partial or ([256, 64] if tiny else [16384, 2048])
    if args.arms and not args.paired:
        p.error("--arms are compared with --paired only")
    try:
        args.arm_settings = {arm: dict((k, int(v)) for k, v in (kv.split("=") for kv in arm.split(",")))
                             for arm in args.arms or []}
    except ValueError:
        p.error(f"--arms {' '.join(args.arms)}: each arm is KNOB=N[,KNOB=N], e.g. COPIES_AHEAD=4")
    if args.paired and (args.profile or args.timeline):
        p.error("--paired runs have no profile or timeline: the runs of one case are interleaved")
    if args.partial[1] < 1:  # a recompute of no token crashed in flash attention ("invalid argument")
        p.error(f"--partial {args.partial[0]} {args.partial[1]}: a partial hit needs one new token at least")
    args.concurrent_size = args.concurrent_size or (256 if tiny else 16384)
    args.store_size = args.store_size or (256 if tiny else 16384)
    if tiny:
        args.chunk_tokens = min(args.chunk_tokens, 64)
        args.max_batched_tokens = min(args.max_batched_tokens, 256)
    return args


def pool_size(need: int) -> int:
    """``need`` with room for headers, capped by what ``/dev/shm`` can hold
    (past that, stores are skipped for lack of space: a future miss)."""
    want = int(need * 1.1) + (256 << 20)
    st = os.statvfs("/dev/shm")
    return min(want, int(st.f_bavail * st.f_frsize * 0.8)) // (2 << 20) * (2 << 20)


def median(xs):
    return statistics.median(xs) if xs else None


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def pinned_peak_gbps(nbytes: int = 1 << 30) -> float | None:
    """The best of five pinned host-to-device copies of ``nbytes``, GB/s (None without a GPU)."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return nbytes / best / GB


class Bench:
    def __init__(self, args, geo, device):
        self.args, self.geo, self.device = args, geo, device
        self.model = LlamaStack(geo, device, out_in=args.weights == "out-in")
        self.model.varlen = args.attention == "varlen"
        bs = args.block_size
        hits = max(args.sizes + [sum(args.partial)]) + args.new_tokens
        conc = max(args.concurrency) * (args.concurrent_size + args.new_tokens)
        reader_blocks = (max(hits, conc) + bs) // bs + 8 * len(args.concurrency)
        writer_blocks = (max(hits, args.store_size) + bs) // bs + 8
        self.reader_kv = paged_kv_caches(geo, reader_blocks, bs, device, seed=1)
        self.writer_kv = paged_kv_caches(geo, writer_blocks, bs, device, seed=2)
        first = next(iter(self.reader_kv.values()))
        self.reader_flat = torch.empty(0, dtype=first.dtype, device=device).set_(
            first.untyped_storage())
        cached, new = args.partial
        # The full hits' prompts, and the partial hit's prefix (stored too).
        self.prompts = {n: prompt(n + args.new_tokens, n, geo.vocab)
                        for n in sorted(set(args.sizes) | {cached})}
        self.partial = prompt(cached + args.new_tokens, cached, geo.vocab)[:cached] + \
            prompt(new, 7 + new, geo.vocab)
        self.refs: dict[int, list[torch.Tensor]] = {}

    def sync(self):
        if self.device != "cpu":
            torch.cuda.synchronize()

    # ---- writer: store the prompts, keep the reference KV -----------------
    def store_prompts(self, cluster: Cluster, fmt: str) -> dict:
        eng = cluster.engine(self.writer_kv, fmt, "store")
        eng.keep_blocks = True
        out = {}
        bs = self.args.block_size
        try:
            for n, toks in self.prompts.items():
                r = Request(f"w-{fmt}-{n}", toks)
                eng.serve([r])
                ids = torch.tensor(r.blocks[: n // bs], device=self.device)
                self.refs[n] = [self.writer_kv[k].index_select(0, ids).clone()
                                for k in self.writer_kv]
                eng.release(r.blocks, force=True)
                out[n] = {"prefill_store_s": r.first_token_at - r.arrival,
                          "committed_after_s": eng.stores_done_at - r.first_token_at}
        finally:
            cluster.close_engine(eng)
        return out

    def store_cost(self, cluster: Cluster, fmt: str) -> dict:
        """The same prefill with and without the connector, interleaved."""
        with_c = cluster.engine(self.writer_kv, fmt, "store")
        plain = Engine(self.model, self.writer_kv, self.args.block_size, None, None,
                       max_batched_tokens=self.args.max_batched_tokens)
        toks = prompt(self.args.store_size, 99, self.geo.vocab)
        rows = {"plain_s": [], "store_s": [], "committed_after_s": []}
        try:
            for i in range(self.args.repeats + 1):
                p = plain.serve([Request(f"p{i}", toks)])[0]
                s = with_c.serve([Request(f"s{i}", toks, cache_salt=f"{fmt}-{i}")])[0]
                if i == 0:
                    continue  # warm-up
                rows["plain_s"].append(p.first_token_at - p.arrival)
                rows["store_s"].append(s.first_token_at - s.arrival)
                rows["committed_after_s"].append(with_c.stores_done_at - s.first_token_at)
        finally:
            cluster.close_engine(with_c)
        med = {k: median(v) for k, v in rows.items()}
        med["cost_ratio"] = med["store_s"] / med["plain_s"] - 1
        med["runs"] = rows
        return med

    # ---- reader ------------------------------------------------------------
    def verify(self, eng: Engine, reqs: list[Request], cached: int) -> bool:
        bs = self.args.block_size
        self.sync()
        ok = not eng.load_errors
        for r in reqs:
            ok &= r.external == cached
            ids = torch.tensor(r.blocks[: cached // bs], device=self.device)
            for ref, name in zip(self.refs[cached], self.reader_kv):
                got = self.reader_kv[name].index_select(0, ids)
                ok &= torch.equal(got.view(torch.int16), ref[: len(ids)].view(torch.int16))
        return bool(ok)

    def hit_runs(self, eng: Engine, toks: list[int], cached: int, count: int = 1,
                 compute: bool = True, profile: str | None = None,
                 phases: PhaseRecorder | None = None) -> dict:
        """``repeats`` timed runs after one warm-up. The uncached tokens are
        fresh in every run: the reader stores the chunks it computes, and a
        repeated prompt would hit them the next time."""
        ttfts, verified, n_runs = [], True, self.args.repeats
        timeline = []
        for i in range(n_runs + 1):
            if phases:
                phases.reset()
            trace = os.path.join(self.args.out, profile) if profile and i == n_runs else None
            reqs, ok = self.one_hit(eng, toks, cached, f"r{i}", count, compute, trace)
            verified &= ok
            if i:
                ttfts.extend(r.first_token_at - r.arrival for r in reqs)
                if phases:
                    timeline.append(phases.phases(reqs[0].arrival, reqs[0].first_token_at))
        out = {"ttft_s": ttfts, "median_s": median(ttfts), "p99_s": percentile(ttfts, 0.99),
               "verified": verified}
        if timeline:
            out["phases_ms"] = median_phases(timeline)
        return out

    def one_hit(self, eng: Engine, toks: list[int], cached: int, tag: str, count: int = 1,
                compute: bool = True, trace: str | None = None) -> tuple[list[Request], bool]:
        """``count`` requests of ``toks`` served at once (uncached tokens
        fresh), on a KV cache poisoned before: the requests, and whether
        every block they loaded equals the reference bit for bit."""
        fill_random(self.reader_flat)  # poison: a block not loaded cannot pass
        self.sync()
        stamp = time.monotonic_ns()
        new = len(toks) - cached
        reqs = [Request(f"{tag}-{j}-{stamp}", toks[:cached] + prompt(new, stamp + j, self.geo.vocab))
                for j in range(count)]
        eng.load_errors.clear()
        if trace:
            with profiled(trace):
                eng.serve(reqs, compute=compute)
        else:
            eng.serve(reqs, compute=compute)
        return reqs, self.verify(eng, reqs, cached)

    def paired_runs(self, engines: dict, toks: list[int], cached: int) -> dict:
        """``--paired``: one hit per variant (a mode in an arm) per round,
        the variants' order rotated each round, after a round of warm-ups:
        {variant: hit_runs' figures}."""
        import maru_connector.transfer.cuda as cuda_engine
        variants = list(engines)
        knobs = {k for settings in self.args.arm_settings.values() for k in settings}
        defaults = {k: getattr(cuda_engine, k) for k in knobs}  # AttributeError: no such knob
        out = {v: {"ttft_s": [], "verified": True} for v in variants}
        for i in range(self.args.repeats + 1):
            for v in variants[i % len(variants):] + variants[:i % len(variants)]:
                eng, arm = engines[v]
                for k, default in defaults.items():
                    setattr(cuda_engine, k, self.args.arm_settings[arm].get(k, default) if arm else default)
                reqs, ok = self.one_hit(eng, toks, cached, f"p{i}")
                out[v]["verified"] &= ok
                if i:
                    out[v]["ttft_s"].append(reqs[0].first_token_at - reqs[0].arrival)
        for row in out.values():
            row.update(median_s=median(row["ttft_s"]), p99_s=percentile(row["ttft_s"], 0.99))
        return out

    def plain_runs(self, toks: list[int], cached: int) -> dict:
        """Recompute (whole prompt, no connector), then compute alone."""
        eng = Engine(self.model, self.reader_kv, self.args.block_size, None, None,
                     max_batched_tokens=self.args.max_batched_tokens)
        eng.keep_blocks = True
        rec = []
        for i in range(min(3, self.args.repeats) + 1):
            r = eng.serve([Request(f"rc{i}", toks)])[0]
            if i:
                rec.append(r.first_token_at - r.arrival)
            if i < min(3, self.args.repeats):
                eng.release(r.blocks, force=True)
        out = {"recompute_s": median(rec), "compute_alone_s": eng.time_suffix(r, cached)}
        if self.device == "cuda":  # the same forward in piecewise CUDA graphs
            eng.graphs = True
            out["compute_alone_graphs_s"] = eng.time_suffix(r, cached)
        eng.release(r.blocks, force=True)
        return out

    def copy_alone(self, cl: Cluster, fmt: str, toks: list[int], cached: int) -> dict:
        """The load's parts without the engine loop: the index retrieve with
        slot-header checks (pins), and the copies alone on the transfer engine."""
        from maru_core.keys import chunk_keys
        from maru_connector.resolve import release_pins, resolve_load

        bs, chunk = self.args.block_size, self.args.chunk_tokens
        engine = cl.transfer_engine(self.reader_kv, fmt == "layerwise")
        client = cl.index.client(timeout_s=10)
        keys = chunk_keys(cl.namespace(fmt), toks)[: cached // chunk]
        blocks = list(range(cached // bs))
        per = chunk // bs
        ids = [tuple(blocks[c * per:(c + 1) * per]) for c in range(len(keys))]
        rows = {"retrieve_s": [], "copy_s": []}
        try:
            for i in range(self.args.repeats + 1):
                t = time.perf_counter()
                pinned = resolve_load(client, cl.pool, engine.fmt, keys, ids)
                t1 = time.perf_counter()
                handle = engine.submit_load(pinned.chunks)
                assert handle.wait_all(60) and handle.error is None
                t2 = time.perf_counter()
                release_pins(client, pinned)
                if i:
                    rows["retrieve_s"].append(t1 - t)
                    rows["copy_s"].append(t2 - t1)
        finally:
            client.close()
            engine.close()
        return {k: median(v) for k, v in rows.items()}

    def run_format(self, fmt: str) -> dict:
        args = self.args
        kv_bytes = self.geo.kv_bytes_per_token_layer * self.geo.layers
        # stored prompts, store-cost runs (fresh keys each), and the chunks
        # the reader stores after partial hits (fresh suffixes each run)
        runs = args.repeats + 1
        need = (sum(self.prompts) + args.store_size * (runs + 1)
                + args.partial[1] * runs * (len(variants(args)) + 1)) * kv_bytes
        res: dict = {"format": fmt}
        with Cluster(self.model, args, fmt, pool_bytes=pool_size(need)) as cl:
            res["stored"] = self.store_prompts(cl, fmt)
            res["store_cost"] = self.store_cost(cl, fmt)
            progress(f"{fmt} store cost {res['store_cost']['cost_ratio']:+.1%}")
            cases = {f"{n}": (self.prompts[n], n) for n in args.sizes}
            cases[f"{args.partial[0]}+{args.partial[1]}"] = (self.partial, args.partial[0])
            rows = {}
            for case, (toks, cached) in cases.items():
                row = {"cached": cached, "new": len(toks) - cached,
                       "bytes": cached * kv_bytes}
                row.update(self.plain_runs(toks, cached))
                row.update(self.copy_alone(cl, fmt, toks, cached))
                eng = cl.engine(self.reader_kv, fmt, "sync")
                try:
                    row["load_alone"] = self.hit_runs(eng, toks, cached, compute=False)
                finally:
                    cl.close_engine(eng)
                if args.paired:
                    row.update(self.paired_case(cl, fmt, toks, cached))
                    progress(f"{fmt} {case}: " + ", ".join(
                        f"{v} {ms(row[v]['median_s'])}" for v in variants(args)))
                    for name, r in paired_ratios(row, args).items():
                        progress(f"  {ratio_line(name, r)}")
                    rows[case] = row
                    continue
                for mode in args.modes:
                    timed = f"{case}/{mode}" in args.timeline
                    eng = cl.engine(self.reader_kv, fmt, mode, timing=timed)
                    trace = (f"trace_{fmt}_{case}_{mode}.json"
                             if f"{case}/{mode}" in args.profile else None)
                    recorder = PhaseRecorder(eng) if timed else None
                    try:
                        row[mode] = self.hit_runs(eng, toks, cached, profile=trace,
                                                  phases=recorder)
                    finally:
                        if recorder:
                            recorder.close()
                        cl.close_engine(eng)
                    progress(f"{fmt} {case} {mode}: {ms(row[mode]['median_s'])}, "
                             f"bits equal {row[mode]['verified']}")
                    if timed:
                        progress(f"  phases (ms from arrival, median): "
                                 f"{describe(row[mode]['phases_ms'])}")
                rows[case] = row
            res["hits"] = rows
            res["concurrency"] = self.concurrency(cl, fmt)
        return res

    def paired_case(self, cl: Cluster, fmt: str, toks: list[int], cached: int) -> dict:
        """Every mode's engine at once, its hits served in turn with the others'."""
        engines = {}
        try:
            for mode in self.args.modes:
                engines[mode] = cl.engine(self.reader_kv, fmt, mode)
            return self.paired_runs({v: (engines[mode], arm) for v, (mode, arm)
                                     in variants(self.args).items()}, toks, cached)
        finally:
            for eng in engines.values():
                cl.close_engine(eng)

    def concurrency(self, cl: Cluster, fmt: str) -> dict:
        n = self.args.concurrent_size
        toks = self.prompts.get(n)
        if toks is None:
            return {}
        out = {}
        kv_bytes = self.geo.kv_bytes_per_token_layer * self.geo.layers
        for mode in ("sync", "async_overlap", "async_auto", "async_auto_graphs"):
            if mode not in self.args.modes:
                continue
            eng = cl.engine(self.reader_kv, fmt, mode)
            try:
                for c in self.args.concurrency:
                    row = self.hit_runs(eng, toks, n, count=c)
                    row["aggregate_gbps_to_last_token"] = c * n * kv_bytes / max(
                        row["ttft_s"]) / GB
                    out[f"{mode}/{c}"] = row
                    progress(f"{fmt} {c} concurrent {mode}: p50 {ms(row['median_s'])}, "
                             f"p99 {ms(row['p99_s'])}")
            finally:
                cl.close_engine(eng)
        return out


class profiled:
    """A torch-profiler timeline of the block: a Chrome trace at ``path`` and,
    printed, each GPU stream's busy time and its longest idle gaps within the
    block's wall time (where a hit waits on something other than its copies
    and its compute)."""

    def __init__(self, path: str):
        from torch.profiler import ProfilerActivity, profile

        self.path = path
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def __enter__(self):
        self.prof.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.start
        self.prof.__exit__(*exc)
        self.prof.export_chrome_trace(self.path)
        gpu = sorted((e for e in self.prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        streams: dict = {}
        for e in gpu:
            streams.setdefault(getattr(e, "device_resource_id", 0), []).append(e)
        print(f"profile {os.path.basename(self.path)}: wall {wall * 1e3:.2f} ms")
        for sid, evs in streams.items():
            busy = sum(e.time_range.elapsed_us() for e in evs)
            gaps = sorted(((b.time_range.start - a.time_range.end, a.name[:40], b.name[:40])
                           for a, b in zip(evs, evs[1:])), reverse=True)[:4]
            span = evs[-1].time_range.end - evs[0].time_range.start
            print(f"  stream {sid}: {len(evs)} ops, busy {busy / 1e3:.2f} ms over "
                  f"{span / 1e3:.2f} ms; longest gaps (us): "
                  + "; ".join(f"{g:.0f} after {a} before {b}" for g, a, b in gaps))
        return False


def variants(args) -> dict:
    """What a case is served in: each mode, or with --arms each mode in
    each arm ("MODE@ARM"): {name: (mode, arm or None)}."""
    return {(mode if arm is None else f"{mode}@{arm}"): (mode, arm)
            for arm in (args.arms or [None]) for mode in args.modes}


def paired_ratios(row: dict, args) -> dict:
    """Each verified variant's TTFT over its unverified twin's, round by
    round: the ratios, their median and quartiles (kept in ``row["paired"]``)."""
    paired = row.setdefault("paired", {})
    for name, (mode, _) in variants(args).items():
        twin = name.replace(mode, f"{mode}_unverified", 1)
        if twin == name or twin not in row:
            continue
        ratios = sorted(a / b for a, b in zip(row[name]["ttft_s"], row[twin]["ttft_s"]))
        q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        paired[name] = {"ratios": ratios, "median": q2, "q1": q1, "q3": q3}
    return paired


def ratio_line(name: str, r: dict) -> str:
    return (f"{name} / its unverified twin, paired over {len(r['ratios'])} rounds: median "
            f"{r['median'] - 1:+.1%} (quartiles {r['q1'] - 1:+.1%} .. {r['q3'] - 1:+.1%})")


def table(result) -> str:
    lines = []
    peak = result.get("pinned_peak_gbps")
    for fmt in result["formats"]:
        lines.append(f"\n### {fmt['format']}\n")
        head = ["hit", "floor", "copy alone", "retrieve", "load alone", "compute alone",
                "compute alone (graphs)", "recompute"] + [
            m for m in result["args"]["columns"]] + ["best / floor", "overlap / max(load, compute)",
                                                   "recompute / best", "bits equal"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for case, row in fmt["hits"].items():
            floor = row["bytes"] / (peak * GB) if peak else None
            modes = [row[m]["median_s"] for m in result["args"]["columns"]]
            best = min(modes)
            load = row["load_alone"]["median_s"]
            over = [row[m]["median_s"] for m in result["args"]["columns"] if "overlap" in m]
            graphs = row.get("compute_alone_graphs_s")
            # the overlap's bound: the load and the compute of the same run mode
            bound = max(load, min(row["compute_alone_s"], graphs or float("inf")))
            cells = [case, ms(floor), ms(row["copy_s"]), ms(row["retrieve_s"]), ms(load),
                     ms(row["compute_alone_s"]), ms(graphs),
                     ms(row["recompute_s"])] + [ms(x) for x in modes] + [
                f"{best / floor:.2f}" if floor else "-",
                f"{min(over) / bound:.2f}" if over else "-",
                f"{row['recompute_s'] / best:.1f}",
                str(all(row[m]["verified"] for m in result["args"]["columns"])
                    and row["load_alone"]["verified"])]
            lines.append("| " + " | ".join(cells) + " |")
        for case, row in fmt["hits"].items():
            for name, r in row.get("paired", {}).items():
                lines.append(f"- {case} {ratio_line(name, r)}")
        sc = fmt["store_cost"]
        lines.append(f"\nstore: prefill {ms(sc['plain_s'])} without connector, "
                     f"{ms(sc['store_s'])} with async store (cost {sc['cost_ratio']:+.1%}); "
                     f"committed {ms(sc['committed_after_s'])} after the first token")
        for key, row in fmt["concurrency"].items():
            lines.append(f"- {key} concurrent: TTFT p50 {ms(row['median_s'])}, p99 "
                         f"{ms(row['p99_s'])}, {row['aggregate_gbps_to_last_token']:.1f} GB/s "
                         f"to the last first token, bits equal {row['verified']}")
    return "\n".join(lines)


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def ms(x):
    return "-" if x is None else f"{x * 1000:.1f} ms"


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fmts = result["formats"]
    fig, axes = plt.subplots(1, len(fmts), figsize=(7 * len(fmts), 4.5), squeeze=False)
    peak = result.get("pinned_peak_gbps")
    for ax, fmt in zip(axes[0], fmts):
        cases = list(fmt["hits"])
        series = ["load_alone", "compute_alone_s", "recompute_s"] + result["args"]["columns"]
        width = 0.8 / len(series)
        for k, name in enumerate(series):
            vals = []
            for c in cases:
                v = fmt["hits"][c][name]
                vals.append((v["median_s"] if isinstance(v, dict) else v) * 1000)
            ax.bar([i + k * width for i in range(len(cases))], vals, width,
                   label=name.replace("_s", "").replace("_", " "))
        if peak:
            for i, c in enumerate(cases):
                floor = fmt["hits"][c]["bytes"] / (peak * GB) * 1000
                ax.hlines(floor, i - width / 2, i + 0.8, colors="k", linestyles="dashed")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases)
        ax.set_yscale("log")
        ax.set_ylabel("ms (dashed: bytes / pinned peak)")
        ax.set_title(f"TTFT of a hit, {fmt['format']} ({result['machine']['device']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None):
    args = parse(argv)
    import maru_connector.transfer.cuda as cuda_engine
    if args.group_below_mib is not None:
        cuda_engine.GROUP_BELOW_BYTES = int(args.group_below_mib * (1 << 20))
    if args.whole_inline_beside_forward:
        cuda_engine.HEAD_ONLY_BESIDE_LONG_FORWARD = False
    if args.head_only_inline:
        cuda_engine.HEAD_ONLY_ALWAYS = True
    if args.head_start_mib is not None:
        cuda_engine.HEAD_START_BYTES = args.head_start_mib << 20
    if args.torch_compare:
        from maru_connector.transfer import device_checksum
        device_checksum.FUSED_COMPARE = False
    if args.no_sum_batches:
        cuda_engine.SUM_BATCHES = False
    if args.copies_ahead is not None:
        cuda_engine.COPIES_AHEAD = args.copies_ahead
    if args.triton_launch:
        from maru_connector.transfer import device_checksum
        device_checksum.DIRECT_LAUNCH = False
    args.columns = list(variants(args))  # the table's and the plot's
    device = "cpu" if args.cpu else "cuda"
    geo = TINY if args.cpu else LLAMA3_8B
    if args.layers:
        geo = geo.scaled(layers=args.layers)
    torch.manual_seed(0)
    result = {
        "machine": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "args": vars(args), "geometry": geo.__dict__,
        "pinned_peak_gbps": pinned_peak_gbps(1 << 30) if device == "cuda" else None,
    }
    os.makedirs(args.out, exist_ok=True)
    bench = Bench(args, geo, device)
    result["attention_check_rel_err"] = check_attention(bench.model)
    result["formats"] = []
    for fmt in args.formats:
        result["formats"].append(bench.run_format(fmt))
        # written after each format: a run cut short keeps what it measured
        with open(os.path.join(args.out, "ttft.json"), "w") as f:
            json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "ttft.png"))
    print(table(result))
    return result


def check_attention(model: LlamaStack) -> float:
    """The attention the forwards run (the cache write, the gather and the
    batch-wide flash kernel) against float64 math, on random inputs: a
    37-token request over 300 tokens of context."""
    from llama_layer import Batch, paged_kv_caches, reference_attention

    g, dev, bs = model.geo, model.device, 16
    cache = next(iter(paged_kv_caches(g.scaled(layers=1), 24, bs, dev, seed=5).values()))
    blocks = torch.randperm(24).tolist()[:-(-337 // bs)]
    batch = Batch.build([(list(range(37)), 300, blocks)], bs, dev)
    q = torch.randn(37, g.heads, g.head, device=dev, dtype=model.dtype)
    kv = torch.randn(37, g.kv_heads, 2 * g.head, device=dev, dtype=model.dtype)
    out = torch.empty(37, g.heads * g.head, device=dev, dtype=model.dtype)
    model.attention(cache, q, kv, batch, out)
    ctx = cache.transpose(1, 2).reshape(-1, g.kv_heads, 2 * g.head)[batch.context].double()
    k, v = ctx[..., :g.head], ctx[..., g.head:]
    ref = reference_attention(q.double().transpose(0, 1)[None], k.transpose(0, 1)[None],
                              v.transpose(0, 1)[None])[0].transpose(0, 1).reshape(37, -1)
    err = float((out.double() - ref).norm() / ref.norm())
    if not err < 2e-2:
        raise AssertionError(f"attention differs from the reference: {err}")
    return err


if __name__ == "__main__":
    main()
