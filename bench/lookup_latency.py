"""Where a hit's lookup time goes, and what an idle machine adds to it.

A hit's copies cannot start before its lookup answers, so every
microsecond of the lookup is on a small hit's critical path. This stores a
prompt through the connector's real halves (the ``ttft_gpu`` harness on the
CPU, a real index process), then:

1. serves fresh hits of it and times, from the hit's arrival, the
   scheduler half's lookup as a whole and its parts: the chunk keys, the
   hand-off to the lookup thread, the index round trip (``retrieve_prefix``:
   match and pin), and the hand-back to the engine thread;
2. times the same ``retrieve_prefix`` round trip in a loop with the index
   and the client idle for 0, 1, 10 and 50 ms before each call: a process
   or thread woken from an idle core pays the wake-up, which a busy loop
   hides; and with only the index idle (the client spinning through the
   50 ms), which tells the index's wake-up from the client's.

    PYTHONPATH=connector:core:tests/connector python3 bench/lookup_latency.py --tokens 4096

Host only (no GPU needed): the same code runs on the GPU machine's host.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import ttft_gpu as harness  # noqa: E402
from maru_connector import lookup as lookup_mod  # noqa: E402
from maru_connector import scheduler as scheduler_mod  # noqa: E402
from maru_core.index import client as client_mod  # noqa: E402
from maru_core.keys import KEY_BYTES  # noqa: E402
from ttft_driver import Request  # noqa: E402
from ttft_setup import Cluster  # noqa: E402

GAPS_S = (0.0, 0.001, 0.01, 0.05)


class Spans:
    """(start, end) of each wrapped call, per name, since the last reset."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spans.setdefault(label, []).append((start, time.perf_counter()))

        setattr(owner, name, timed)
        self._undo.append((owner, name, inner))

    def first(self, label: str) -> tuple[float, float]:
        return self.spans[label][0]

    def reset(self) -> None:
        self.spans.clear()

    def close(self) -> None:
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)


def lookup_phases(fmt: str, tokens: int, hits: int) -> dict:
    args = harness.parse(["--cpu", "--layers", "32", "--sizes", str(tokens),
                          "--partial", str(tokens), "16", "--formats", fmt, "--out", "/tmp"])
    geo = harness.TINY.scaled(layers=32)
    bench = harness.Bench(args, geo, "cpu")
    spans = Spans()
    spans.wrap(scheduler_mod.MaruSchedulerHalf, "get_num_new_matched_tokens", "lookup")
    spans.wrap(scheduler_mod.MaruSchedulerHalf, "_keys", "keys")
    spans.wrap(lookup_mod.LookupService, "_match_all", "on the lookup thread")
    spans.wrap(client_mod.IndexClient, "retrieve_prefix", "round trip")
    rows: list[dict] = []
    gaps: dict[str, float] = {}
    try:
        with Cluster(bench.model, args, fmt, harness.pool_size(1 << 30)) as cluster:
            bench.store_prompts(cluster, fmt)
            eng = cluster.engine(bench.reader_kv, fmt, "sync")
            prompt = bench.prompts[tokens]
            try:
                for i in range(hits + 3):
                    spans.reset()
                    req = Request(f"hit-{i}", prompt[:tokens] + harness.prompt(1, 10_000 + i, geo.vocab))
                    time.sleep(0.05)  # as between the harness's hits: everything idle
                    arrival = time.perf_counter()
                    eng.serve([req])
                    if i < 3:
                        continue  # warm-up
                    lk, keys = spans.first("lookup"), spans.first("keys")
                    thread, rtt = spans.first("on the lookup thread"), spans.first("round trip")
                    rows.append({
                        "lookup_answered_ms": (lk[1] - arrival) * 1e3,
                        "keys_ms": (keys[1] - keys[0]) * 1e3,
                        "hand_off_ms": (thread[0] - keys[1]) * 1e3,
                        "round_trip_ms": (rtt[1] - rtt[0]) * 1e3,
                        "hand_back_ms": (lk[1] - thread[1]) * 1e3,
                    })
                sched = eng.scheduler
                keys = sched._lookup_keys(sched._keys(sched._state(req)), 0)[0]
                group = sched._early_pin_group() or 1
            finally:
                cluster.close_engine(eng)
            spans.close()
            client = cluster.index.client(timeout_s=10)
            for gap, spin in [(g, False) for g in GAPS_S] + [(GAPS_S[-1], True)]:
                times = []
                for _ in range(40):
                    if spin:
                        until = time.perf_counter() + gap
                        while time.perf_counter() < until:
                            pass
                    else:
                        time.sleep(gap)
                    start = time.perf_counter()
                    matched, locations = client.retrieve_prefix(keys, group)
                    times.append((time.perf_counter() - start) * 1e3)
                    client.unpin(keys[: len(locations) * KEY_BYTES] if locations else keys)
                label = "client spinning, index idle" if spin else "idle"
                gaps[f"{gap * 1e3:g} ms {label}"] = statistics.median(times[5:])
            client.close()
    finally:
        spans.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"format": fmt, "tokens": tokens, "hits": len(rows), "median_ms": med,
            "round_trip_after_idle_ms": gaps}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hits", type=int, default=20)
    parser.add_argument("--formats", nargs="+", default=["chunkwise", "layerwise"])
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()}, "runs": []}
    for fmt in args.formats:
        run = lookup_phases(fmt, args.tokens, args.hits)
        result["runs"].append(run)
        med = ", ".join(f"{k} {v:.3f}" for k, v in run["median_ms"].items())
        idle = ", ".join(f"{k}: {v:.3f}" for k, v in run["round_trip_after_idle_ms"].items())
        print(f"{fmt} {args.tokens} tokens, medians of {run['hits']} hits (ms): {med}")
        print(f"  retrieve_prefix round trip after the index and client idled (ms): {idle}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
