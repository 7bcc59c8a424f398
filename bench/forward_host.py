"""What the stand-in's one-token forward costs the host and the GPU (CUDA).

A hit whose forward computes one token is bound by two paths: the copies,
and the engine thread that queues the forward. This splits the forward's
side into host time (the time to queue it, with the GPU held busy by a
sleep kernel so that it never holds the host back), GPU time (events around
the same queued forward) and the wall time of the forward alone, in
piecewise graphs, for the stand-in as shipped (projections stored [out, in]
and applied by ``F.linear``, as vLLM's; attention as one variable-length
kernel per layer) and as it was before (``x @ w`` over [in, out] weights;
one attention kernel per request); then the same for the pieces alone, the
attention alone, and one stream wait per layer (what
``wait_for_layer_load`` adds on the device side).

    PYTHONPATH=connector:core:tests/connector python3 bench/forward_host.py --out FILE.json
    python3 bench/forward_host.py --plot FILE.json      # FILE.png: host and GPU ms per case
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llama_layer import LLAMA3_8B, Batch, LlamaStack, PiecewiseForward, paged_kv_caches

BLOCK = 16


def host_and_gpu_ms(fn, repeats: int) -> dict:
    """Median host ms to queue ``fn()`` behind a 50 ms sleep kernel, its GPU
    ms, and the wall ms of ``fn()`` alone until the GPU is done."""
    host, gpu, alone = [], [], []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # about 50 ms: the host runs ahead of the GPU
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        alone.append((time.perf_counter() - t) * 1e3)
    return {k: round(statistics.median(v[1:]), 3) for k, v in
            (("host_ms", host), ("gpu_ms", gpu), ("alone_ms", alone))}


def plot(path: str) -> str:
    """Host and GPU ms of each case's forward, side by side: a PNG beside ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(path))["rows"]
    labels = [f"{r['context'] // 1024}k, {r['weights']}, {r['attention']}" for r in rows]
    y = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    ax.barh([i + 0.2 for i in y], [r["forward"]["gpu_ms"] for r in rows], 0.4, label="GPU")
    ax.barh([i - 0.2 for i in y], [r["forward"]["host_ms"] for r in rows], 0.4,
            label="host (queueing it)")
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms, one-token forward in piecewise graphs (context, weights, attention)")
    ax.set_title("The stand-in's forward is bound by its GPU time, not its host time")
    ax.legend(loc="lower right")
    fig.tight_layout()
    png = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(png, dpi=120)
    return png


def measure_stand_in(kv: dict, out_in: bool, varlen: bool, contexts: list[int],
                     repeats: int) -> list[dict]:
    """One row per context: the forward, the pieces alone and the attention
    alone, for the stand-in with these weights and this attention."""
    geo, dev = LLAMA3_8B, torch.device("cuda")
    model = LlamaStack(geo, dev, out_in=out_in)
    model.varlen = varlen
    rows = []
    for context in contexts:
        batch = Batch.build([([7], context, list(range(context // BLOCK + 1)))], BLOCK, dev)
        fwd = PiecewiseForward(model, kv, batch)

        def attention_only():
            for i in range(geo.layers):
                _, q, kvn = fwd.outputs[i]
                model.attend(fwd.rows[i], q, kvn, batch, fwd.attn)
        rows.append({
            "context": context, "weights": "out_in" if out_in else "in_out",
            "attention": "varlen" if varlen else "per_request",
            "forward": host_and_gpu_ms(lambda: fwd(batch), repeats),
            "pieces_only": host_and_gpu_ms(lambda: [g.replay() for g in fwd.graphs], repeats),
            "attention_only": host_and_gpu_ms(attention_only, repeats),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", metavar="FILE.json", help="only plot a run's results")
    args = ap.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    geo, dev = LLAMA3_8B, torch.device("cuda")
    blocks = max(args.contexts) // BLOCK + 2
    kv = paged_kv_caches(geo, blocks, BLOCK, dev)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    # (weights [out, in] by F.linear, attention as one kernel for the batch):
    # as shipped, then each of the two before
    for out_in, varlen in ((True, True), (False, True), (True, False)):
        for row in measure_stand_in(kv, out_in, varlen, args.contexts, args.repeats):
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()  # the last stand-in's weights and graphs are gone
    event = torch.cuda.Event()
    event.record()
    result["stream_waits_32"] = host_and_gpu_ms(
        lambda: [torch.cuda.current_stream().wait_event(event) for _ in range(geo.layers)],
        args.repeats)
    print("32 stream waits:", result["stream_waits_32"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
