"""`marucache demo`: two real vLLM engines sharing one cache, on this machine.

The embedded default, end to end: a pool file in `/dev/shm`, an index
process, a local sidecar (`marucache sidecar` on a Unix socket in a temp
dir) that hands the pool to the engines' connectors and exports their
counters on `/metrics`, and real vLLM CPU engines with a tiny randomly
initialised Llama built on the spot. The workload is several documents with several questions
each, so every question shares its document's prefix:

1. a reference engine without the connector serves every request (the
   recompute baseline: its TTFT and its outputs);
2. engine A serves the first question of each document: a miss, after which
   its connector stores the document's KV into the pool;
3. engine B, another process, serves every question: the documents' KV
   comes from the pool.

The model is float32, so greedy tokens of a hit equal recompute except on
true ties. The proof does not rest on tokens: right after each prefill both
engines hand over the KV they hold, and every prefix B loaded must be byte
for byte the KV A computed. It prints TTFT without the cache and with a hit,
the hit rate, the bytes loaded and stored (as the sidecar's `/metrics`
reports them), the KV and token checks and what they proved, and writes a
plot of per-request TTFT. It exits 0 only when the KV check held for every
hit. Pool, socket and processes are removed on exit and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .demo_report import DemoReport, print_report, write_plot

DEMO_CACHE = "demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=3, help="shared prefixes (default: %(default)s)")
    parser.add_argument("--questions", type=int, default=3, help="requests per document (default: %(default)s)")
    parser.add_argument("--document-tokens", type=int, default=1536, help="tokens per document (default: %(default)s)")
    parser.add_argument("--question-tokens", type=int, default=48, help="tokens per question (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default: %(default)s)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="maru_kv_chunk_tokens (default: %(default)s)")
    parser.add_argument("--layerwise", action="store_true", help="one object per (chunk, layer) instead of per chunk")
    parser.add_argument("--sync-load", action="store_true", help="load synchronously instead of parking the request")
    parser.add_argument("--hidden-size", type=int, default=1024, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="model depth (default: %(default)s)")
    parser.add_argument("--pool-size", default="1Gi", help="pool size, e.g. 512Mi, 2Gi (default: %(default)s)")
    parser.add_argument("--plot", default=os.path.join("out", "demo_ttft.png"), help="PNG of per-request TTFT (default: %(default)s)")
    parser.add_argument("--workdir", default=None, help="where engine and index logs go (default: a temp dir)")


def _check_args(args: argparse.Namespace) -> None:
    for name in ("documents", "questions", "document_tokens", "question_tokens", "max_tokens", "chunk_tokens", "layers"):
        if getattr(args, name) < 1:
            raise SystemExit(f"marucache demo: --{name.replace('_', '-')} must be at least 1")
    if args.document_tokens < args.chunk_tokens:
        raise SystemExit(
            f"marucache demo: --document-tokens ({args.document_tokens}) must be at least --chunk-tokens "
            f"({args.chunk_tokens}), or nothing can be shared"
        )
    if args.hidden_size % 64:
        raise SystemExit("marucache demo: --hidden-size must be a multiple of 64 (heads of 64)")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    # Ctrl-C and SIGTERM both unwind through the ExitStack below.
    signal.signal(signal.SIGTERM, _interrupt)
    workdir = args.workdir or tempfile.mkdtemp(prefix="marucache-demo-")
    os.makedirs(workdir, exist_ok=True)
    try:
        report = _run_demo(args, workdir)
    except KeyboardInterrupt:
        print("\nmarucache demo: interrupted; pool and processes removed", file=sys.stderr)
        return 130
    print_report(report)
    if args.plot:
        write_plot(report, args.plot)
        print(f"\nper-request TTFT plot: {args.plot}")
    print(f"logs: {workdir}")
    return 0 if report.proved else 1


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run_demo(args: argparse.Namespace, workdir: str) -> DemoReport:
    from tqdm import tqdm

    from maru_connector.config import make_kv_transfer_config
    from maru_tools.engine import EngineProcess, EngineSpec, prefix_kv_mismatch
    from maru_tools.index_process import IndexProcess, unique_pool_path
    from maru_tools.sidecar_process import SidecarProcess
    from maru_tools.tiny_model import TinyModelSpec, build_tiny_model
    from maru_tools.workload import random_tokens, shared_prefix_workload

    requests = shared_prefix_workload(args.documents, args.questions, args.document_tokens, args.question_tokens)
    prompt_len = args.document_tokens + args.question_tokens
    with ExitStack() as stack, tqdm(total=6, desc="marucache demo", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str("building the model")
        heads = args.hidden_size // 64
        spec = TinyModelSpec(
            hidden_size=args.hidden_size, num_layers=args.layers, num_heads=heads,
            num_kv_heads=max(1, heads // 2), head_dim=64, intermediate_size=args.hidden_size * 11 // 4,
        )
        model_dir = str(build_tiny_model(spec))
        bar.update()

        bar.set_postfix_str("starting the index")
        index = IndexProcess(unique_pool_path("marucache-demo"), pool_size=args.pool_size, log_dir=workdir)
        stack.callback(index.close)
        index.start()
        bar.update()

        bar.set_postfix_str("starting the sidecar")
        socket_dir = tempfile.mkdtemp(prefix="marucache-sock-")  # short: a socket path has at most 107 bytes
        stack.callback(shutil.rmtree, socket_dir, ignore_errors=True)
        sidecar = SidecarProcess(index.pool_path, Path(socket_dir) / "maru.sock", index.url,
                                 token_file=index.token_file, cache=DEMO_CACHE,
                                 log_path=Path(workdir) / "sidecar.log")
        stack.callback(sidecar.stop)
        sidecar.start()
        sidecar.wait_ready()
        bar.update()

        bar.set_postfix_str("starting three vLLM engines")
        base = EngineSpec(
            model_dir=model_dir, block_size=32, max_model_len=prompt_len + args.max_tokens + 64,
            max_num_batched_tokens=max(2048, prompt_len + 64), num_gpu_blocks_override=1024,
        )
        knobs = dict(kv_chunk_tokens=args.chunk_tokens, use_layerwise=args.layerwise,
                     async_load=not args.sync_load, overlap_load_with_compute=not args.sync_load,
                     lookup_timeout_s=1.0)
        engines: dict[str, Any] = {}
        with_connector = ("A", "B")
        for name in ("reference", *with_connector):
            config = None
            if name in with_connector:
                config = make_kv_transfer_config(index.url, sidecar_socket=str(sidecar.socket_path),
                                                 token_file=index.token_file, cache_name=DEMO_CACHE, **knobs)
            spec_n = EngineSpec(**{**base.__dict__, "kv_transfer_config": config})
            engines[name] = EngineProcess(spec_n, os.path.join(workdir, f"engine-{name}.log"), wait=False)
            stack.callback(engines[name].close)
        for serial, (name, engine) in enumerate(engines.items()):
            engine.wait_ready()
            # The first requests of a fresh engine pay one-off set-up costs;
            # keep them out of the measured TTFTs. Engines with the connector
            # get prompts shorter than a chunk, so that nothing is stored.
            warm_len = args.chunk_tokens // 2 if name in with_connector else prompt_len
            engine.generate([random_tokens(warm_len, seed=10_000 + 10 * serial + i) for i in range(2)], 1)
        bar.update()

        prompts = [r.token_ids for r in requests]
        bar.set_postfix_str("reference: recomputing every request")
        reference = engines["reference"].generate(prompts, args.max_tokens)
        bar.update()

        bar.set_postfix_str("engine A stores the documents; engine B hits them")
        first_questions = [i for i, r in enumerate(requests) if r.question == 0]
        stored = engines["A"].generate([prompts[i] for i in first_questions], args.max_tokens, dump_kv=True)
        _wait_stored(index, args.documents * (args.document_tokens // args.chunk_tokens)
                     * (args.layers if args.layerwise else 1))
        hits = engines["B"].generate(prompts, args.max_tokens, dump_kv=True)
        bar.update()
        computed = {requests[i].document: r.prompt_kv for i, r in zip(first_questions, stored)}
        shared = args.document_tokens // args.chunk_tokens * args.chunk_tokens
        kv_identical = sum(
            prefix_kv_mismatch(computed[req.document], hit.prompt_kv, prompt_len, len(req.token_ids),
                               shared, args.layers) is None
            for req, hit in zip(requests, hits)
        )

        # What a Prometheus scraping the sidecar sees (A and B share this sidecar).
        metrics = _sum_by_name(sidecar.metrics())
        return DemoReport(
            requests=requests,
            reference=reference,
            stored={i: r for i, r in zip(first_questions, stored)},
            hits=hits,
            hit_tokens=int(metrics["maru_lookup_hit_tokens_total"]),
            prompt_tokens=sum(len(p) for p in prompts),
            bytes_loaded=int(metrics["maru_load_bytes_total"]),
            bytes_stored=int(metrics["maru_store_bytes_total"]),
            load_failures=int(metrics["maru_load_failures_total"]),
            kv_identical=kv_identical,
            config=dict(knobs, model=f"Llama {args.layers}x{args.hidden_size} (random weights, {spec.dtype})"),
        )


def _sum_by_name(samples: dict) -> dict[str, float]:
    """Sample values of `/metrics` summed over their labels (failure reasons)."""
    total: dict[str, float] = {}
    for (name, _labels), value in samples.items():
        total[name] = total.get(name, 0.0) + value
    return total


def _wait_stored(index, expected_keys: int, timeout_s: float = 30.0) -> None:
    """Stores are asynchronous: wait until the index holds the documents' keys."""
    deadline = time.monotonic() + timeout_s
    while int(index.stats()["keys"]) < expected_keys:
        if time.monotonic() > deadline:
            print(f"marucache demo: only {index.stats()['keys']} of {expected_keys} keys stored after "
                  f"{timeout_s:.0f}s; continuing", file=sys.stderr)
            return
        time.sleep(0.1)
