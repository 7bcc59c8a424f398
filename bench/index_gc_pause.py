"""How long the index's garbage collections hold its event loop.

A collection runs in the thread that allocated last, the index's event loop
mostly, and a full one (generation 2) walks every tracked object: while it
runs, no client is answered. The index freezes its start-up objects
(``maru_core.index.service.freeze_startup_objects``) so that a full
collection walks only what serving creates. Two measurements:

- ``heap``: in a fresh interpreter that imports what ``marucache index``
  imports, the time of a full collection before and after the freeze (the
  same heap, alternating is not needed: nothing else runs);
- ``served``: a real ``marucache index`` process under clients that
  reconnect all the time (new connections, leases and replies are what a
  serving index allocates), its ``maru_index_gc_pause_seconds`` histogram
  scraped at the end: how many collections of each generation ran, their
  total time and the bucket that holds the longest.

    PYTHONPATH=core .venv/bin/python bench/index_gc_pause.py [--seconds 30] [--clients 16] [--held 300]
        [--rounds 2] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
import urllib.request

from maru_core.index.api import IndexUnavailable
from maru_core.index.client import IndexClient
from maru_core.index.launcher import IndexProcess, unique_shm_path

_HEAP = r"""
import gc, json, statistics, time
import maru_core.cli, maru_core.index.cli, maru_core.index.server, maru_core.index.service

def full(n=21):
    times = []
    for _ in range(n):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return {"median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times), "tracked": len(gc.get_objects())}

before = full()
frozen_objects = maru_core.index.service.freeze_startup_objects()
print(json.dumps({"unfrozen": before, "frozen": full(), "frozen_objects": frozen_objects}))
"""


def heap() -> dict:
    """Full-collection time of the index's start-up heap, unfrozen and frozen."""
    done = subprocess.run([sys.executable, "-c", _HEAP], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _churn(url: str, stop: threading.Event, counts: list[int]) -> None:
    """Connect, 100 lookups, close; again until ``stop`` (a connection refused by the
    peer's connection budget is tried again 0.1 s later)."""
    keys = [os.urandom(16) for _ in range(64)]
    while not stop.is_set():
        try:
            with IndexClient(url, timeout_s=10, heartbeat=False) as client:
                for _ in range(100):
                    client.retrieve(keys)
                    counts[0] += 1
        except IndexUnavailable:
            counts[1] += 1
            time.sleep(0.1)


def _gc_samples(metrics_url: str) -> dict[tuple[str, str], float]:
    """``maru_index_gc_pause_seconds``' samples: (name and bucket, generation) -> value."""
    body = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    line = re.compile(r'^maru_index_gc_pause_seconds_(\w+)\{generation="(\d)"(?:,le="([^"]+)")?\} (\S+)$', re.M)
    return {(f"{kind}:{le or ''}", generation): float(value) for kind, generation, le, value in line.findall(body)}


def _gc_pauses(before: dict, after: dict) -> dict:
    """Collections between two scrapes, by generation: how many, their total and the bucket of the longest."""
    figures = {}
    for generation in "012":
        def grew(key: str) -> float:
            return after[(key, generation)] - before[(key, generation)]

        count = grew("count:")
        buckets = sorted((float(key.split(":")[1]), grew(key)) for key, g in after
                         if g == generation and key.startswith("bucket:"))  # fmt: skip
        longest = next((le for le, cumulative in buckets if cumulative >= count), None) if count else None
        figures[generation] = {"count": int(count), "total_ms": round(1e3 * grew("sum:"), 3),
                               "longest_at_most_ms": None if longest is None else 1e3 * longest}
    return figures


#: ``marucache index`` with the start-up freeze undone: the baseline of the A/B (nothing in the product turns it off).
_UNFROZEN = ("import sys; import maru_core.index.service as service; service.freeze_startup_objects = lambda: 0; "
             "from maru_core.cli import main; sys.exit(main())")


def _hold(url: str, stop: threading.Event, held: int, counts: list[int]) -> None:
    """Open ``held`` connections, 10 a second, and keep them (a connection's objects outlive
    young collections: what full ones walk)."""
    clients = []
    try:
        while not stop.is_set():
            if len(clients) < held:
                client = IndexClient(url, timeout_s=10)
                client.connect()
                clients.append(client)
                counts[2] = len(clients)
            stop.wait(0.1)
    finally:
        for client in clients:
            client.close()


def served(seconds: float, clients: int, held: int, frozen: bool) -> dict:
    """A real index under reconnecting clients and ``held`` kept connections: its GC pauses by generation."""
    pool = unique_shm_path("bench-gc")
    proc = IndexProcess(pool, pool_size="256Mi", extra_args=["--metrics-port", "0", "--metrics-addr", "127.0.0.1"])
    if not frozen:
        proc.args[1:3] = ["-c", _UNFROZEN]  # was [python, -m, maru_core.cli, index, ...]
    try:
        with proc.start():
            assert proc.metrics_url is not None  # started with --metrics-port
            at_start = _gc_samples(proc.metrics_url)  # after start-up's own collection (the freeze's)
            stop, counts = threading.Event(), [0, 0, 0]
            threads = [threading.Thread(target=_churn, args=(proc.url, stop, counts), daemon=True)
                       for _ in range(clients)]  # fmt: skip
            threads.append(threading.Thread(target=_hold, args=(proc.url, stop, held, counts), daemon=True))
            for thread in threads:
                thread.start()
            started = time.monotonic()
            while time.monotonic() - started < seconds:
                time.sleep(min(5.0, seconds))
                print(f"  {time.monotonic() - started:5.1f} s: {counts[0]} lookups, {counts[1]} refused connects, {counts[2]} held", file=sys.stderr, flush=True)
            stop.set()
            for thread in threads:
                thread.join(30)
            return {"frozen": frozen, "seconds": seconds, "clients": clients, "held": counts[2],
                    "lookups": counts[0], "refused_connects": counts[1],
                    "gc_by_generation": _gc_pauses(at_start, _gc_samples(proc.metrics_url))}
    finally:
        if os.path.exists(pool):
            os.unlink(pool)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of each served run (default 30)")
    parser.add_argument("--clients", type=int, default=16, help="reconnecting client threads (default 16)")
    parser.add_argument("--held", type=int, default=300, help="connections opened and kept, 10 a second (default 300)")
    parser.add_argument("--rounds", type=int, default=2, help="served runs of each kind, alternating (default 2)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    figures: dict = {"command": " ".join(sys.argv),
                     "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "heap": heap()}
    h = figures["heap"]
    print(f"start-up heap: full collection {h['unfrozen']['median_ms']:.2f} ms median "
          f"({h['unfrozen']['tracked']} objects), frozen {h['frozen']['median_ms']:.3f} ms "
          f"({h['frozen']['tracked']} objects)", flush=True)
    figures["served"] = runs = []
    for round_ in range(args.rounds):
        for frozen in (False, True):
            print(f"round {round_ + 1}, {'frozen' if frozen else 'unfrozen'}:", file=sys.stderr, flush=True)
            runs.append(served(args.seconds, args.clients, args.held, frozen))
            for generation, g in runs[-1]["gc_by_generation"].items():
                print(f"  {'frozen' if frozen else 'unfrozen'}, generation {generation}: {g['count']} collections, "
                      f"{g['total_ms']} ms in all, longest <= {g['longest_at_most_ms']} ms", flush=True)
            if args.out:
                with open(args.out, "w") as out:
                    json.dump(figures, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
