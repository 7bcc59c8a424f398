"""Prompt tokens two `vllm serve` engines take from caches, against the ideal.

A workload replay as a user would run it (vLLM's CPU build, the tiny
float32 Llama of `maru_tools.tiny_model`, a real index and pool on one
machine): a shared system prompt, multi-turn conversations and documents
asked several questions, each request sent to one of two engines at random
(seeded), one at a time, streamed. It runs twice on the same requests and
engine choices: two engines with vLLM's prefix caching alone, then two with
prefix caching and the connector.

*Served* is what vLLM's own `/metrics` count: `vllm:prefix_cache_hits`
(the engine's local cache) plus `vllm:external_prefix_cache_hits` (the
pool), summed over both engines. The *ideal* is every full vLLM block of a
prompt whose prefix any engine computed earlier (a prompt's and its
output's tokens), up to the last full block before the prompt's last token
(vLLM always computes that one). Also reported: TTFT p50/p99 per run.

Then, on one engine of the connector run: a pool hit's TTFT against the
same engine's local prefix-cache hit of the same prompt, at 1k and 4k
tokens (the other engine stores each prompt first).

    python bench/workload_replay.py --out bench/results/workload_replay [--chunk-tokens 256]

Writes `replay.json` and `replay.png` into `--out` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from maru_connector.config import make_kv_transfer_config
from maru_tools.engine import EngineSpec
from maru_tools.index_process import IndexProcess
from maru_tools.tiny_model import TinyModelSpec, build_tiny_model
from maru_tools.vllm_server import VllmServer
from maru_tools.workload import random_tokens


@dataclass
class Request:
    """One request of the replay; ``follows`` is the turn before it in its conversation."""

    name: str
    engine: int
    own_tokens: list[int]  # what this request adds after its context
    context: list[int] = field(default_factory=list)
    follows: "Request | None" = None
    answer: list[int] = field(default_factory=list)

    def prompt(self) -> list[int]:
        if self.follows is None:
            return self.context + self.own_tokens
        earlier = self.follows
        return earlier.prompt() + earlier.answer + self.own_tokens


def build_workload(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    system = random_tokens(args.system_tokens, seed=args.seed)
    conversations: list[list[Request]] = []
    for c in range(args.conversations):
        turns: list[Request] = []
        for t in range(args.turns):
            tokens = random_tokens(rng.randint(40, 160), seed=args.seed * 1000 + c * 50 + t + 1)
            turns.append(Request(f"conv{c}.turn{t}", rng.randrange(2), tokens, system if t == 0 else [],
                                 turns[-1] if turns else None))  # fmt: skip
        conversations.append(turns)
    for d in range(args.documents):
        doc = random_tokens(rng.randint(600, 1800), seed=args.seed * 7000 + d + 1)
        conversations.extend(
            [Request(f"doc{d}.q{q}", rng.randrange(2), random_tokens(rng.randint(20, 80), seed=d * 100 + q + 9),
                     system + doc)]  # fmt: skip
            for q in range(args.questions)
        )
    order: list[Request] = []
    queues = [list(c) for c in conversations]
    while queues:  # interleave streams at random, each in its own order
        queue = rng.choice(queues)
        order.append(queue.pop(0))
        if not queue:
            queues.remove(queue)
    return order


def ideal_hit_tokens(prompt: list[int], computed: set[tuple[int, ...]], block: int) -> int:
    """Tokens of the prompt's leading full blocks whose prefix was computed before."""
    hit = 0
    for end in range(block, len(prompt), block):  # the block holding the last token is always computed
        if tuple(prompt[:end]) not in computed:
            break
        hit = end
    return hit


def add_computed(tokens: list[int], computed: set[tuple[int, ...]], block: int) -> None:
    for end in range(block, len(tokens) + 1, block):
        computed.add(tuple(tokens[:end]))


def cache_hits(server: VllmServer) -> tuple[float, float]:
    """(local, external) prefix-cache hit tokens so far, from vLLM's /metrics."""
    local = external = 0.0
    for (name, _), value in server.metrics().items():
        if name == "vllm:prefix_cache_hits_total":
            local += value
        elif name == "vllm:external_prefix_cache_hits_total":
            external += value
    return local, external


def replay(workload: list[Request], servers: list[VllmServer], block: int, label: str) -> dict:
    for request in workload:
        request.answer = []
    computed: set[tuple[int, ...]] = set()
    before = [cache_hits(s) for s in servers]
    ttfts, ideal, prompt_tokens = [], 0, 0
    for i, request in enumerate(workload, 1):
        prompt = request.prompt()
        ideal += ideal_hit_tokens(prompt, computed, block)
        prompt_tokens += len(prompt)
        tokens, ttft, _ = servers[request.engine].stream(prompt, 16)
        request.answer = tokens
        ttfts.append(ttft)
        add_computed(prompt + tokens[:-1], computed, block)
        if i % 20 == 0 or i == len(workload):
            print(f"[{time.strftime('%H:%M:%S')}] {label}: {i}/{len(workload)} requests", flush=True)
    after = [cache_hits(s) for s in servers]
    local = sum(a[0] - b[0] for a, b in zip(after, before))
    external = sum(a[1] - b[1] for a, b in zip(after, before))
    return {"requests": len(workload), "prompt_tokens": prompt_tokens, "ideal_hit_tokens": ideal,
            "local_hit_tokens": local, "pool_hit_tokens": external,
            "served_over_ideal": (local + external) / ideal if ideal else None,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": percentile(ttfts, 0.99),
            "answers": [r.answer for r in workload]}  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pool_against_local(writer: VllmServer, reader: VllmServer, index: IndexProcess, sizes: list[int],
                       repeats: int) -> dict:  # fmt: skip
    """Per size: median TTFT of a pool hit on ``reader`` and of its local hit of the same prompt."""
    out = {}
    for size in sizes:
        pool_s, local_s = [], []
        for r in range(repeats):
            prompt = random_tokens(size + 1, seed=90_000 + size + r)
            keys = index.stats()["keys"]
            writer.stream(prompt, 1)
            deadline = time.monotonic() + 30
            while index.stats()["keys"] == keys and time.monotonic() < deadline:  # the store commits after
                time.sleep(0.05)
            time.sleep(0.3)
            pool_s.append(reader.stream(prompt, 1)[1])
            local_s.append(reader.stream(prompt, 1)[1])
        out[str(size)] = {"pool_hit_ttft_s": statistics.median(pool_s), "local_hit_ttft_s": statistics.median(local_s),
                          "ratio": statistics.median(pool_s) / statistics.median(local_s),
                          "pool_samples_s": pool_s, "local_samples_s": local_s}  # fmt: skip
        print(f"[{time.strftime('%H:%M:%S')}] {size}-token hit: pool {out[str(size)]['pool_hit_ttft_s'] * 1e3:.1f} ms, "
              f"local {out[str(size)]['local_hit_ttft_s'] * 1e3:.1f} ms", flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    runs = [("prefix caching alone", result["baseline"]), ("prefix caching + MaruCache", result["connector"])]
    for i, (label, run) in enumerate(runs):
        ideal = run["ideal_hit_tokens"]
        local, pool = run["local_hit_tokens"] / ideal, run["pool_hit_tokens"] / ideal
        ax.barh(i, local, color="#4c72b0", label="vLLM's local cache" if i == 0 else None)
        ax.barh(i, pool, left=local, color="#dd8452", label="MaruCache pool" if i == 1 else None)
        ax.text(local + pool + 0.01, i, f"{local + pool:.1%}", va="center")
    ax.axvline(0.95, color="grey", linestyle="--", linewidth=1, label="target 95 %")
    ax.set_yticks(range(len(runs)), [label for label, _ in runs])
    ax.set_xlim(0, 1.15)
    ax.set_xlabel("prompt tokens served from a cache / ideal")
    ax.set_title(f"Two engines: chunk {result['chunk_tokens']}, block {result['block_size']} tokens", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128, help="vLLM's block size (the CPU backend's default: 128)")
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--documents", type=int, default=6)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--hit-sizes", type=int, nargs="*", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="maru-replay-"))
    model_dir = str(build_tiny_model(TinyModelSpec(num_layers=4, seed=0)))
    base = EngineSpec(model_dir=model_dir, block_size=args.block_size, max_model_len=8192,
                      max_num_batched_tokens=8192, num_gpu_blocks_override=2048, enable_prefix_caching=True)
    workload = build_workload(args)
    result: dict = {"chunk_tokens": args.chunk_tokens, "block_size": args.block_size, "args": vars(args) | {"out": str(args.out)}}
    servers = [VllmServer(base, work / f"plain-{i}.log").start() for i in range(2)]
    try:
        result["baseline"] = replay(workload, servers, args.block_size, "prefix caching alone")
    finally:
        for s in servers:
            s.close()
    with IndexProcess(pool_size="4Gi", log_dir=str(work)) as index:
        servers = []
        try:
            for i in range(2):
                stats = work / f"stats-{i}"
                stats.mkdir()
                config = make_kv_transfer_config(index.url, pool_path=index.pool_path, token=index.token,
                                                 stats_dir=str(stats), kv_chunk_tokens=args.chunk_tokens)  # fmt: skip
                servers.append(VllmServer(replace(base, kv_transfer_config=config), work / f"maru-{i}.log").start())
            result["connector"] = replay(workload, servers, args.block_size, "prefix caching + MaruCache")
            result["pool_against_local"] = pool_against_local(servers[0], servers[1], index, args.hit_sizes,
                                                              args.repeats)  # fmt: skip
        finally:
            for s in servers:
                s.close()
    same = result["baseline"].pop("answers") == result["connector"].pop("answers")
    result["answers_equal"] = same
    (args.out / "replay.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "replay.png")
    print("| run | ideal hit tokens | local | pool | served / ideal | TTFT p50 | TTFT p99 |")
    print("|---|---|---|---|---|---|---|")
    for name in ("baseline", "connector"):
        r = result[name]
        print(f"| {name} | {r['ideal_hit_tokens']} | {r['local_hit_tokens']:.0f} | {r['pool_hit_tokens']:.0f} | "
              f"{r['served_over_ideal']:.3f} | {r['ttft_p50_s'] * 1e3:.1f} ms | {r['ttft_p99_s'] * 1e3:.1f} ms |")
    for size, r in result["pool_against_local"].items():
        print(f"{size}-token hit: pool / local TTFT {r['ratio']:.2f}")
    print(f"answers equal with and without the connector: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
