"""Where a sliced request's turns go on an index's event loop (``index_attacks.py --loop --steps``).

A long callback of ``PeerTurns._next_round`` says only that some connection's
turn was long. ``StepTimer`` times each turn of a connection (its
``_step_job``, and ``_answer_buffered``, which starts a job with its first
step) in CPU time of the loop's thread, filed under where the job stood before
the turn: its innermost two generator frames, e.g. ``retrieve_sliced:100 >
_committed_sliced:70`` (a lookup slice), and whether the loop was contended
then (a share of ``shared_turn_s``: what another peer's request waits for).
"""

from __future__ import annotations

import time
from collections import defaultdict

from maru_core.index.connection import Connection


def where(job) -> str:
    """The innermost two frames of a job (a generator delegating to others), as ``name:line``."""
    frames = []
    while job is not None and hasattr(job, "gi_code"):
        frame = job.gi_frame
        frames.append(f"{job.gi_code.co_name}:{frame.f_lineno if frame else '-'}")
        job = job.gi_yieldfrom
    return " > ".join(frames[-2:])


#: CPU ms above which a turn is counted per peer whatever its kind (``StepTimer.long_turns``):
#: a handful of rare long steps in a 4 s window, too few to show in a kind's p99, can set a
#: heartbeat's p99 (a large reserve's placement is one such step: 1-3 ms on 2 cores).
LONG_TURN_MS = (0.5, 1.0, 2.0)


class StepTimer:
    """Times the turns of every ``Connection`` while installed and ``counting``."""

    def __init__(self) -> None:
        self.counting = False
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._long: dict[str, list] = {}  # peer: [count over each LONG_TURN_MS..., [(ms, label), ...]]
        self._step_job = self._answer_buffered = None

    def _record(self, conn: Connection, label: str, seconds: float) -> None:
        self.samples[label].append(seconds)
        ms = 1000 * seconds
        if ms > LONG_TURN_MS[0]:
            entry = self._long.setdefault(conn.peer_key, [0] * len(LONG_TURN_MS) + [[]])
            for i, limit in enumerate(LONG_TURN_MS):
                entry[i] += ms > limit
            entry[-1] = sorted(entry[-1] + [(round(ms, 3), label)], reverse=True)[:3]

    def long_turns(self) -> dict[str, dict]:
        """Per peer: how many of its turns took longer than each of ``LONG_TURN_MS`` (CPU ms),
        and its three longest, with where they stood."""
        return {peer: {**{f"over_{ms}ms": entry[i] for i, ms in enumerate(LONG_TURN_MS)}, "longest": entry[-1]}
                for peer, entry in sorted(self._long.items())}  # fmt: skip

    def install(self) -> None:
        step_job, answer_buffered = Connection._step_job, Connection._answer_buffered
        self._step_job, self._answer_buffered = step_job, answer_buffered
        timer = self

        def timed_step(conn: Connection) -> None:
            if not timer.counting or conn._job is None:
                return step_job(conn)
            label = f"{where(conn._job)} [{'contended' if conn._server.turns.contended else 'alone'}]"
            started = time.thread_time()
            step_job(conn)
            timer._record(conn, label, time.thread_time() - started)

        def timed_answer(conn: Connection) -> None:
            if not timer.counting:
                return answer_buffered(conn)
            started = time.thread_time()
            answer_buffered(conn)
            label = "answer frames" + (", a job's first step" if conn._job is not None else "")
            timer._record(conn, label, time.thread_time() - started)

        Connection._step_job, Connection._answer_buffered = timed_step, timed_answer

    def uninstall(self) -> None:
        if self._step_job is not None:
            Connection._step_job, Connection._answer_buffered = self._step_job, self._answer_buffered

    def table(self, top: int, least: int = 100) -> list[dict]:
        """The ``top`` kinds of turn (``least`` of them at least) by their 99th percentile, in ms."""
        rows = []
        for label, samples in self.samples.items():
            if len(samples) < least:
                continue
            ordered = sorted(samples)
            rows.append({"turn": label, "count": len(ordered),
                         "p50_ms": round(1000 * ordered[len(ordered) // 2], 3),
                         "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 3),
                         "max_ms": round(1000 * ordered[-1], 3)})  # fmt: skip
        return sorted(rows, key=lambda row: -row["p99_ms"])[:top]


def long_turn_lines(long_turns: dict[str, dict]) -> str:
    """``StepTimer.long_turns`` a line per peer."""
    limits = ", ".join(f">{ms} ms" for ms in LONG_TURN_MS)
    lines = [f"    long turns by peer (CPU ms; counts {limits}; the longest)"]
    lines += [f"    {peer:16} {[counts[f'over_{ms}ms'] for ms in LONG_TURN_MS]} {counts['longest']}"
              for peer, counts in long_turns.items()]  # fmt: skip
    return "\n".join(lines)


def step_lines(rows: list[dict]) -> str:
    lines = [f"    {'turn (where the job stood before it; CPU ms)':72} {'count':>7} {'p50':>7} {'p99':>7} {'max':>7}"]
    lines += [f"    {r['turn'][:72]:72} {r['count']:>7} {r['p50_ms']:>7.3f} {r['p99_ms']:>7.3f} {r['max_ms']:>7.3f}"
              for r in rows]  # fmt: skip
    return "\n".join(lines)
