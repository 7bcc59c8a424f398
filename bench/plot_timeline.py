"""Per-phase timelines of hits, from a trace written by
``bench/ttft_async.py --trace FILE`` (one process and multiprocessing).

    .venv/bin/python bench/plot_timeline.py out/trace.jsonl bench/ttft_async_timeline.png [TOKENS]

Picks, for each caller process that served hits, the last full hit of a
TOKENS-token prompt (default 4096) served alone, and draws its phases from
arrival to first token: the lookup, the resolve (retrieve, pins, header
checks; on the loader thread when parked, else on the engine thread), each
layer's copy, the release, the engine steps, the forward and its per-layer
waits. Each hit is named by the path it took, read from the trace: parked
(the loader got it), in the step with overlap (the forward started before
its copies ended), or in the step, whole (the sync path).
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from trace_phases import lone_requests, load_path, load_trace  # noqa: E402


def _hits(events, tokens: int):
    """(events, arrival, first token, multiprocessing?) of the last lone full
    hit of ``tokens`` tokens per caller process."""
    by_caller = {}
    for hit in lone_requests(events):
        if hit.external_tokens == tokens - 1:
            by_caller[hit.caller_pid] = (hit.window, hit.arrival, hit.first_token, hit.multiprocessing)
    return sorted(by_caller.values(), key=lambda hit: (hit[3], load_path(hit[0])))


def _spans(window, t0):
    """Named (start, end) spans in milliseconds from arrival."""
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    spans, opened = [], {}
    marks = []
    for t, _pid, thread, event, detail in window:
        name = event[:-1]
        if event.endswith(">") and name in ("get_num_new_matched_tokens", "resolve_load", "_run_load",
                                            "wait_for_layer_load", "get_finished"):
            opened[(thread, name)] = t
        elif event.endswith("<") and (thread, name) in opened:
            spans.append((name, ms(opened.pop((thread, name))), ms(t)))
        elif event == "_mark_layer>":
            marks.append((f"layer {detail} landed", ms(t)))
        elif event in ("_release>", "update_state_after_alloc>", "token", "submit>"):
            marks.append(({"_release>": "release", "update_state_after_alloc>": "alloc / scheduled",
                           "token": "first token", "submit>": "parked, load submitted"}[event], ms(t)))
        elif event == "build_connector_meta>":
            marks.append(("step (nothing computed)" if detail[0] == 0 else "step (forward)", ms(t)))
    return spans, marks


ROWS = {"get_num_new_matched_tokens": "lookup", "get_finished": "engine waits for the loader",
        "resolve_load": "resolve + pin", "_run_load": "copy thread: layer copies",
        "wait_for_layer_load": "forward: layer waits"}


def main(trace: str, png: str, tokens: int = 4096) -> None:
    events = load_trace(trace)
    hits = _hits(events, tokens)
    if not hits:
        raise SystemExit(f"no lone {tokens}-token hit in {trace}")
    fig, axes = plt.subplots(len(hits), 1, figsize=(11, 2.6 * len(hits)), squeeze=False)
    for ax, (window, t0, t1, mp) in zip(axes[:, 0], hits):
        spans, marks = _spans(window, t0)
        rows = list(ROWS)
        for name, a, b in spans:
            ax.barh(rows.index(name), max(b - a, 0.05), left=a, height=0.6, color="tab:blue")
        for label, t in marks:
            color = "tab:red" if "step" in label else "black"
            ax.axvline(t, color=color, lw=0.6, ls=":" if "step" in label else "-")
            if "step" not in label:
                ax.text(t, len(rows) - 0.4, label, rotation=90, fontsize=7, va="top")
        ax.set_yticks(range(len(rows)), [ROWS[r] for r in rows], fontsize=8)
        ax.set_xlim(0, (t1 - t0) * 1e3 * 1.02)
        ax.set_xlabel("ms since the request arrived (dotted red: engine steps)")
        ax.set_title(f"{tokens}-token hit, {load_path(window)}, multiprocessing {'on' if mp else 'off'}: "
                     f"TTFT {(t1 - t0) * 1e3:.1f} ms", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
