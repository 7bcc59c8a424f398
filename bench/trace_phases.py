"""Medians of where lone requests' time goes, from a ``bench/ttft_async.py --trace`` file.

    .venv/bin/python bench/trace_phases.py out/trace.jsonl [TOKENS ...]

For hits of TOKENS tokens (default 1024 and 4096), per process model and
per path the hit took (parked, in the step with overlap, in the step whole;
read from the trace): ms from arrival to the
lookup's answer, the start and end of the resolve, the last layer landed and
the first token. For misses of at least the smallest size, by prompt
length (a lookup that found nothing, then a store): the first token, and
the time the connector's calls took on the engine's thread before it
(lookup, step metadata, ``start_load_kv``, ``wait_for_save``,
``get_finished``), which is what the connector adds to a miss.
"""

from __future__ import annotations

import bisect
import collections
import json
import statistics
import sys
from typing import Any, NamedTuple

ENGINE_THREAD_CALLS = ("get_num_new_matched_tokens", "start_load_kv", "wait_for_save", "get_finished",
                       "build_connector_meta", "update_connector_output")


class Lone(NamedTuple):
    """One request served alone: its trace events from arrival to first token."""

    window: list[Any]
    arrival: float
    first_token: float
    caller_pid: int
    multiprocessing: bool
    external_tokens: int  # what the pool supplied (0: a miss)
    prompt_tokens: int | None  # None in traces written before it was recorded


def load_trace(path: str) -> list[Any]:
    """The trace's events, ``[monotonic_s, pid, thread, event, detail]``, in time order."""
    with open(path, encoding="utf-8") as fh:
        return sorted((json.loads(line) for line in fh), key=lambda e: e[0])


def lone_requests(events: list[Any]):
    """Every request of the (time-ordered) trace served alone: no other
    request was live (arrived, first token not yet out) at any time between
    its arrival and its first token."""
    times = [e[0] for e in events]
    adds = {e[4]: e for e in events if e[3] == "add_request>"}
    tokens: dict[str, float] = {}
    for e in events:
        if e[3] == "token":
            tokens.setdefault(e[4], e[0])
    live = sorted((add[0], tokens.get(rid, float("inf")), rid) for rid, add in adds.items())
    for alloc in (e for e in events if e[3] == "update_state_after_alloc>"):
        req_id, external, *prompt = alloc[4]
        caller_id = req_id.rsplit("-", 1)[0]  # vLLM appends a suffix to the caller's id
        add, first = adds.get(caller_id), tokens.get(caller_id)
        if add is None or first is None:
            continue
        if any(rid != caller_id and start < first and end > add[0] for start, end, rid in live):
            continue  # another request was live beside it
        window = events[bisect.bisect_left(times, add[0]):bisect.bisect_right(times, first)]
        yield Lone(window, add[0], first, add[1], len({e[1] for e in window}) > 1, external,
                   prompt[0] if prompt else None)


def load_path(window) -> str:
    """How a hit was loaded, from what its trace shows."""
    if any(e[3] == "submit>" for e in window):
        return "async, parked (overlap)"
    loads_started = [e[0] for e in window if e[3] == "start_load_kv<"]
    landed = [e[0] for e in window if e[3] == "_mark_layer>"]
    if loads_started and landed and min(loads_started) < max(landed):
        return "in the step, overlapped (async, not parked)"
    return "in the step, whole (sync)"


def _span_ms(window, names) -> float:
    """Total ms of the named calls (> to <) on each thread of the window."""
    total, opened = 0.0, {}
    for t, pid, thread, event, _ in window:
        name = event[:-1]
        if name not in names:
            continue
        if event.endswith(">"):
            opened[(pid, thread, name)] = t
        elif (pid, thread, name) in opened:
            total += t - opened.pop((pid, thread, name))
    return total * 1e3


def hit_phases(events, tokens: int) -> dict:
    rows = collections.defaultdict(list)
    for hit in lone_requests(events):
        if hit.external_tokens != tokens - 1:
            continue
        t0, window = hit.arrival, hit.window
        at = lambda name: [(e[0] - t0) * 1e3 for e in window if e[3] == name]  # noqa: E731
        resolve_start, resolve_end, landed = at("resolve_load>"), at("resolve_load<"), at("_mark_layer>")
        if not (resolve_start and resolve_end and landed):
            continue
        rows[("multiprocessing on" if hit.multiprocessing else "multiprocessing off", load_path(window))].append({
            "lookup answered": max(at("get_num_new_matched_tokens<")),
            "resolve starts": resolve_start[0], "resolved": resolve_end[0],
            "every layer landed": max(landed), "first token": (hit.first_token - t0) * 1e3,
            "engine steps": sum(e[3] == "build_connector_meta>" for e in window),
        })
    return rows


def miss_costs(events, min_tokens: int) -> dict:
    """Lone misses that store, of at least ``min_tokens`` tokens, by process
    model and prompt length (all of them, length unknown, when the trace does
    not say it): (first token, the connector's calls on the engine thread) in
    ms. A prompt vLLM's own prefix cache served is no miss: it stores nothing."""
    rows = collections.defaultdict(list)
    for miss in lone_requests(events):
        if miss.external_tokens or (miss.prompt_tokens is not None and miss.prompt_tokens < min_tokens):
            continue
        if not any(e[3] == "wait_for_save>" and e[4] for e in miss.window):
            continue
        mp = "multiprocessing on" if miss.multiprocessing else "multiprocessing off"
        rows[(mp, miss.prompt_tokens or 0)].append(
            ((miss.first_token - miss.arrival) * 1e3, _span_ms(miss.window, ENGINE_THREAD_CALLS)))
    return rows


def main(trace: str, sizes: list[int]) -> None:
    events = load_trace(trace)
    for tokens in sizes:
        for (mp, path), hits in sorted(hit_phases(events, tokens).items()):
            print(f"\n{tokens}-token hits, {mp}, {path}: {len(hits)} hits, medians in ms")
            for phase in hits[0]:
                print(f"  {phase:20s} {statistics.median(h[phase] for h in hits):7.1f}")
    for (mp, tokens), misses in sorted(miss_costs(events, min(sizes)).items()):
        ttft = statistics.median(m[0] for m in misses)
        conn = statistics.median(m[1] for m in misses)
        share = statistics.median(m[1] / m[0] for m in misses)
        print(f"\n{tokens or 'all'}-token misses, {mp}: {len(misses)}; first token {ttft:.1f} ms, "
              f"the connector's calls on the engine thread before it {conn:.2f} ms "
              f"({share:.1%} of the first token; medians)")


if __name__ == "__main__":
    main(sys.argv[1], [int(a) for a in sys.argv[2:]] or [1024, 4096])
