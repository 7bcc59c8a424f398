"""Medians of where lone requests' time goes, from a ``bench/ttft_async.py --trace`` file.

    .venv/bin/python bench/trace_phases.py out/trace.jsonl [TOKENS ...]

For hits of TOKENS tokens (default 1024 and 4096), per process model and
per path the hit took (parked, in the step with overlap, in the step whole;
read from the trace as ``plot_timeline`` does): ms from arrival to the
lookup's answer, the start and end of the resolve, the last layer landed and
the first token. For misses of at least the smallest size (engine A: a
lookup that found nothing, then a store): the first token, and the time the
connector's calls took on the engine's thread before it (lookup, step
metadata, ``start_load_kv``, ``wait_for_save``, ``get_finished``), which is
what the connector adds to a miss.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys

from plot_timeline import _path

ENGINE_THREAD_CALLS = ("get_num_new_matched_tokens", "start_load_kv", "wait_for_save", "get_finished",
                       "build_connector_meta", "update_connector_output")


def _windows(events):
    """(window, arrival, first token, multiprocessing?, external tokens,
    prompt tokens or None) of each request served alone: from its arrival
    to its first token, with no other request arriving in between."""
    adds = {e[4]: e for e in events if e[3] == "add_request>"}
    tokens = {}
    for e in events:
        if e[3] == "token":
            tokens.setdefault(e[4], e[0])
    for alloc in (e for e in events if e[3] == "update_state_after_alloc>"):
        req_id, external, *prompt = alloc[4]
        caller_id = req_id.rsplit("-", 1)[0]  # vLLM appends a suffix to the caller's id
        add, first = adds.get(caller_id), tokens.get(caller_id)
        if add is None or first is None:
            continue
        window = [e for e in events if add[0] <= e[0] <= first]
        if sum(e[3] == "add_request>" for e in window) == 1:
            yield window, add[0], first, len({e[1] for e in window}) > 1, external, \
                (prompt[0] if prompt else None)


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
    for window, t0, t1, mp, external, _ in _windows(events):
        if external != tokens - 1:
            continue
        at = lambda name: [(e[0] - t0) * 1e3 for e in window if e[3] == name]  # noqa: E731
        resolve_start, resolve_end, landed = at("resolve_load>"), at("resolve_load<"), at("_mark_layer>")
        if not (resolve_start and resolve_end and landed):
            continue
        rows[("multiprocessing on" if mp else "multiprocessing off", _path(window))].append({
            "lookup answered": max(at("get_num_new_matched_tokens<")),
            "resolve starts": resolve_start[0], "resolved": resolve_end[0],
            "every layer landed": max(landed), "first token": (t1 - t0) * 1e3,
            "engine steps": sum(e[3] == "build_connector_meta>" for e in window),
        })
    return rows


def miss_costs(events, min_tokens: int) -> dict:
    """Lone misses of at least ``min_tokens`` tokens (all lone misses when
    the trace does not say the prompt's length)."""
    rows = collections.defaultdict(list)
    for window, t0, t1, mp, external, prompt in _windows(events):
        if external or (prompt is not None and prompt < min_tokens):
            continue
        rows["multiprocessing on" if mp else "multiprocessing off"].append(
            ((t1 - t0) * 1e3, _span_ms(window, ENGINE_THREAD_CALLS)))
    return rows


def main(trace: str, sizes: list[int]) -> None:
    events = [json.loads(line) for line in open(trace, encoding="utf-8")]
    for tokens in sizes:
        for (mp, path), hits in sorted(hit_phases(events, tokens).items()):
            print(f"\n{tokens}-token hits, {mp}, {path}: {len(hits)} hits, medians in ms")
            for phase in hits[0]:
                print(f"  {phase:20s} {statistics.median(h[phase] for h in hits):7.1f}")
    for mp, misses in sorted(miss_costs(events, min(sizes)).items()):
        ttft = statistics.median(m[0] for m in misses)
        conn = statistics.median(m[1] for m in misses)
        print(f"\nmisses, {mp}: {len(misses)}; first token {ttft:.1f} ms, the connector's calls on the "
              f"engine thread before it {conn:.2f} ms (medians)")


if __name__ == "__main__":
    main(sys.argv[1], [int(a) for a in sys.argv[2:]] or [1024, 4096])
