"""Prefix hits on several GPUs of one host: tensor parallelism, and many
engines on one pool.

    PYTHONPATH=connector:core:tests/connector python3 bench/multi_gpu.py \\
        --experiment tp --processes 2 --gpus 2 --out DIR
    ... --experiment engines --processes 8 --gpus 8 --out DIR
    ... --experiment tp --processes 2 --gpus 1 --out DIR   # both ranks on GPU 0
    ... --cpu --experiment tp --processes 2 --gpus 1 --out DIR   # tiny, on the CPU (CI)

A real ``marucache index`` process and its pool in ``/dev/shm``, one
process per rank or engine (``bench/multi_gpu_worker.py``; placement and
prefixes: ``bench/multi_gpu_plan.py``), each with the real CUDA transfer
engine over the pool registered with CUDA, the connector's ``Storer`` for
the writes and ``resolve_load`` (pins, slot-header checks) for the loads.

``tp``: each rank loads its own shard of a 16k-token hit (keys carry the TP
rank) and computes the first token with an all-reduce after each attention
and MLP (NCCL; gloo where ranks share a GPU, which NCCL refuses). TTFT is
from the first rank's start to the last rank's first token, against the
floor: the slowest GPU's bytes at its pinned peak (ranks on one GPU share
its link), and ``FLOOR_FACTOR`` times it as the target.

``engines``: n engines load a 16k-token hit at the same moment, from one
prefix (``same``) and from n different ones (``different``): the aggregate
GB/s from the pool (bytes of every hit over the time until the last landed,
``sync`` mode) against n times one GPU's pinned peak, and the last first
token against n times one hit's floor.

Every hit's blocks are checked against the writer's. Writes
``multi_gpu_<tag>.json`` (and ``.png`` where matplotlib imports) into
``--out``, prints a Markdown table; exit status 1 when a process failed,
timed out or loaded bytes other than the writer's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE] + [os.path.join(ROOT, part) for part in ("connector", "core", "tools")]

from multi_gpu_plan import (  # noqa: E402
    COLLECTIVES, EXPERIMENTS, MODES, PREFIX_CASES, PlanError, build_plan, check_room,
    check_shape, pool_bytes_needed, summarize_runs, table)

GRACE_S = 20.0  # after one process failed, how long the others get to report


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", choices=EXPERIMENTS, required=True)
    p.add_argument("--processes", type=int, required=True,
                   help="TP size (tp) or number of engines (engines)")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs to spread the processes over, round-robin (default: as many as "
                        "processes); fewer GPUs than processes puts several on each")
    p.add_argument("--collective", choices=COLLECTIVES, default="auto",
                   help="the TP all-reduce: auto (NCCL, gloo where ranks share a GPU); nccl "
                        "falls back to gloo, saying so, where NCCL refuses the placement")
    p.add_argument("--tokens", type=int, default=None, help="cached tokens of a hit (16384)")
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--cases", nargs="+", choices=PREFIX_CASES, default=list(PREFIX_CASES),
                   help="engines: hits from one prefix and/or from as many as engines")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--format", choices=["chunkwise", "layerwise"], default="chunkwise")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="tokens per forward of a writer's prefill (4096)")
    p.add_argument("--verify-payload", choices=["on", "off"], default="on",
                   help="loads check the bytes they receive against the writer's checksums, as "
                        "the connector does by default (maru_verify_payload)")
    p.add_argument("--cpu", action="store_true", help="tiny model and sizes on the CPU")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds for the whole run; the processes are killed after")
    p.add_argument("--tag", default=None, help="name of the output files (default from the args)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.gpus = args.gpus or args.processes
    args.tokens = args.tokens or (512 if args.cpu else 16384)
    args.prefill_chunk = args.prefill_chunk or (256 if args.cpu else 4096)
    if args.tokens <= 0 or args.tokens % args.chunk_tokens:
        p.error(f"--tokens {args.tokens} must be a positive multiple of --chunk-tokens "
                f"{args.chunk_tokens} (a hit is whole chunks)")
    if args.chunk_tokens % args.block_size:
        p.error(f"--chunk-tokens {args.chunk_tokens} must be a multiple of --block-size "
                f"{args.block_size}")
    if args.repeats < 1 or args.new_tokens < 1:
        p.error("--repeats and --new-tokens must be at least 1")
    if args.experiment == "tp":
        args.cases = ["tp"]
    args.tag = args.tag or (f"{args.experiment}{args.processes}_on_{args.gpus}gpu"
                            + ("_cpu" if args.cpu else ""))
    return args


def worker_env() -> dict:
    env = dict(os.environ)
    paths = [os.path.join(ROOT, p) for p in ("connector", "core", "tools", "tests/connector", "bench")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off
    # one host: gloo and NCCL's bootstrap on loopback, whatever the hostname resolves to
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(plan, args, index, run_dir: str) -> list[dict]:
    """One worker per process; their reports (or why each has none)."""
    from maru_tools.index_process import free_port

    port = free_port()
    procs = []
    for rank in range(plan.processes):
        cfg = {"rank": rank, "plan": plan.as_dict(), "cpu": args.cpu, "tokens": args.tokens,
               "new_tokens": args.new_tokens, "repeats": args.repeats, "modes": args.modes,
               "cases": args.cases, "layers": args.layers, "block_size": args.block_size,
               "chunk_tokens": args.chunk_tokens, "format": args.format,
               "prefill_chunk": args.prefill_chunk, "timeout_s": args.timeout,
               "verify_payload": args.verify_payload == "on",
               "dist_port": port, "index_url": index.url, "index_token": index.token,
               "pool_path": index.pool_path, "out_dir": run_dir}
        path = os.path.join(run_dir, f"config{rank}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        log = open(os.path.join(run_dir, f"rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, "multi_gpu_worker.py"),
                                        path], env=worker_env(), stdout=log,
                                       stderr=subprocess.STDOUT), log))
    try:
        why = watch([p for p, _ in procs], args.timeout)
    finally:  # also on SIGTERM (a `timeout` around this run): no worker outlives it
        for proc, log in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            log.close()
    reports = []
    for rank, (proc, _) in enumerate(procs):
        try:
            with open(os.path.join(run_dir, f"rank{rank}.json")) as f:
                reports.append(json.load(f))
        except (OSError, ValueError):
            reports.append({"rank": rank, "ok": False,
                            "error": why.get(rank, f"no report (exit {proc.returncode})")})
    return reports


def watch(procs: list, timeout: float, grace: float = GRACE_S) -> dict[int, str]:
    """Wait for every process; once one failed, the others get ``grace``
    seconds more (they may wait on it in a collective); past ``timeout`` all
    are killed. Why each killed one ended."""
    deadline = time.monotonic() + timeout
    failed: list[int] = []
    why: dict[int, str] = {}
    while None in [p.poll() for p in procs]:  # every one polled: its returncode set
        if not failed:
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:  # once: the grace does not slide
                deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    why[i] = (f"killed: rank {failed[0]} failed and this one did not finish "
                              f"within {grace:.0f} s" if failed else
                              f"killed: the run passed --timeout {timeout:.0f} s")
                    p.send_signal(signal.SIGKILL)
                    p.wait()
            break
        time.sleep(0.2)
    return why


def plot(summaries: list[dict], plan, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not importable here"
    labels = [f"{s['case']}/{s['mode']}" for s in summaries]
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 3, 4))
    ttft = [(s["median_ttft_s"] or 0) * 1e3 for s in summaries]
    ax.bar(range(len(labels)), ttft, 0.6, label="TTFT (last first token)")
    for i, s in enumerate(summaries):
        if s.get("floor_s"):
            ax.hlines(s["floor_s"] * 1e3, i - 0.4, i + 0.4, colors="k", linestyles="dashed")
        if s.get("n_times_one_hit_floor_s"):
            ax.hlines(s["n_times_one_hit_floor_s"] * 1e3, i - 0.4, i + 0.4, colors="r",
                      linestyles="dotted")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("ms (dashed: floor; dotted: n x one hit's floor)")
    ax.set_title(f"{plan.experiment}: {plan.processes} processes on {plan.gpus} GPU(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


def machine(cpu: bool) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version(),
           "cpus": os.cpu_count()}
    if not cpu and torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def run(args):
    """The run's result, its plan, and whether it passed."""
    sys.path[:0] = [os.path.join(ROOT, "tests", "connector")]
    from llama_layer import LLAMA3_8B, TINY

    geo = TINY if args.cpu else LLAMA3_8B
    if args.layers:
        geo = geo.scaled(layers=args.layers)
    available = None
    if not args.cpu:
        import torch

        available = torch.cuda.device_count()
    check_shape(args.experiment, args.processes, args.gpus, geo.heads, geo.kv_heads, geo.ffn,
                available)
    plan = build_plan(args.experiment, args.processes, args.gpus, args.collective,
                      "cpu" if args.cpu else "cuda")
    need = pool_bytes_needed(plan, args.tokens, geo.kv_bytes_per_token_layer * geo.layers)
    st = os.statvfs("/dev/shm")
    check_room(need, st.f_bavail * st.f_frsize)
    result = {"args": vars(args), "plan": plan.as_dict(), "machine": machine(args.cpu),
              "pool_bytes": need}
    run_dir = os.path.join(args.out, args.tag)
    os.makedirs(run_dir, exist_ok=True)
    from maru_tools.index_process import IndexProcess

    index = IndexProcess(pool_size=str(need), log_dir=run_dir)
    try:
        index.start(timeout_s=120)
        print(f"index on {index.url}, pool {need / 2**30:.1f} GiB in {index.pool_path}; "
              f"{plan.processes} processes (logs in {run_dir})", flush=True)
        reports = launch(plan, args, index, run_dir)
    finally:
        index.close()
    result["reports"] = reports
    failed = [r for r in reports if not r.get("ok")]
    for r in failed:
        print(f"!! rank {r['rank']} failed: {r.get('error')}", flush=True)
        log = os.path.join(run_dir, f"rank{r['rank']}.log")
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                print("".join(f.readlines()[-25:]), flush=True)
    result["collective_used"] = sorted({r.get("collective") for r in reports if r.get("collective")})
    summaries = []
    if not failed:
        try:
            summaries = [summarize_runs(plan, reports, case, mode)
                         for case in args.cases for mode in args.modes]
        except Exception as exc:  # the reports still go into the JSON
            result["summary_error"] = f"{type(exc).__name__}: {exc}"
            print(f"!! the reports could not be summarized: {result['summary_error']}", flush=True)
    result["summaries"] = summaries
    passed = not failed and bool(summaries) and all(s["verified"] for s in summaries)
    return result, plan, passed


def main(argv=None) -> int:
    args = parse(argv)
    # SIGTERM (from `timeout`) unwinds: the workers are killed and the index's
    # pool file leaves /dev/shm, which the next run needs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(args.out, exist_ok=True)
    try:
        result, plan, passed = run(args)
    except PlanError as exc:
        print(f"!! {exc}", flush=True)
        return 2
    except Exception as exc:  # e.g. the index did not start: say why, exit non-zero
        traceback.print_exc()
        print(f"!! the run failed before any figure: {type(exc).__name__}: {exc}", flush=True)
        return 1
    path = os.path.join(args.out, f"multi_gpu_{args.tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if result["summaries"]:
        print(table(result["summaries"], plan))
        print(f"collective: {', '.join(result['collective_used']) or '-'}")
        try:
            print(plot(result["summaries"], plan,
                       os.path.join(args.out, f"multi_gpu_{args.tag}.png")))
        except Exception as exc:  # a plot is no figure: the run stands
            print(f"no plot: {type(exc).__name__}: {exc}")
    print(f"{'PASSED' if passed else 'FAILED'}: {path}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
