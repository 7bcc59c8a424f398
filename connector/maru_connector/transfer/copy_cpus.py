"""Which CPU cores the CPU backend's copy threads run on.

On the CPU, a load's copies and the forward they overlap compete for the
same cores unless the copies have cores of their own: on two cores shared
with the forward's OpenMP team, partial hits ran at 0.90-1.03 x their sync
time, with a core reserved at 0.97 x in every row, the forward waiting only
for the first layer's copy (bench/RESULTS.md, "Copies on a core of their
own"). vLLM plans for this: with a KV connector configured, its
CPU worker leaves cores out of the OpenMP team (``VLLM_CPU_NUM_OF_RESERVED_CPU``;
one more per rank for KV transfer) and binds the team to the rest through
``OMP_PLACES`` (or ``GOMP_CPU_AFFINITY`` / ``KMP_AFFINITY`` with those
OpenMP runtimes preloaded). Threads inherit the affinity of the thread that
starts them, and the engine thread is the team's first thread, so without
a pin of their own the copy threads would share the team's cores even when
cores were left free for them.

``maru_copy_cpus`` says where they go: ``"auto"`` (the allowed cores outside
the OpenMP team's binding, when there is one and cores are left; else
unpinned), ``"none"`` (unpinned), or a list such as ``"3"`` or ``"2,6-7"``.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from ..log import get_logger

logger = get_logger(__name__)

__all__ = ["CopyCpusError", "openmp_cpus", "parse_cpu_list", "parse_setting", "pin_this_thread",
           "process_cpus", "resolve_copy_cpus"]


class CopyCpusError(ValueError):
    """``maru_copy_cpus`` is not "auto", "none" or a list of allowed cores."""


def parse_cpu_list(text: str) -> set[int]:
    """``"0,2-4"`` -> {0, 2, 3, 4} (the Linux cpu-list format); ValueError
    when the text is not one."""
    cpus: set[int] = set()
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"{part!r} is not a core number or a range like 2-5")
        first, last = int(m[1]), int(m[2] or m[1])
        if last < first:
            raise ValueError(f"range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError("no cores listed")
    return cpus


def _places_cpus(places: str) -> set[int]:
    """The cores named by an ``OMP_PLACES`` list of explicit places:
    ``{0,1,2}``, ``{0},{1}``, ``{0:4}`` (4 cores from 0), ``{0:4:2}``."""
    cpus: set[int] = set()
    places = places.strip()
    if not places.startswith("{"):
        raise ValueError("not a list of explicit places")  # e.g. "cores", "threads"
    for body in re.findall(r"\{([^}]*)\}", places):
        for item in body.split(","):
            item = item.strip()
            m = re.fullmatch(r"(\d+)(?::(\d+)(?::(\d+))?)?", item)
            if m is None:
                raise ValueError(f"place item {item!r}")
            start, count, stride = int(m[1]), int(m[2] or 1), int(m[3] or 1)
            cpus.update(start + i * stride for i in range(count))
    if not cpus:
        raise ValueError("no places")
    return cpus


def openmp_cpus(environ: Mapping[str, str]) -> set[int] | None:
    """The cores this process's OpenMP team is bound to, from the variables
    vLLM's CPU worker sets; None when there is no binding it can read."""
    try:
        if environ.get("OMP_PLACES") and environ.get("OMP_PROC_BIND", "").lower() not in (
                "", "false"):
            return _places_cpus(environ["OMP_PLACES"])
        if environ.get("GOMP_CPU_AFFINITY"):
            return parse_cpu_list(environ["GOMP_CPU_AFFINITY"])
        m = re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))
        if m:
            return parse_cpu_list(m[1])
    except ValueError:
        return None
    return None


_CPUSET_FILES = (
    "/sys/fs/cgroup/cpuset.cpus.effective",  # cgroup v2
    "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",  # cgroup v1
    "/sys/devices/system/cpu/online",  # no cpuset: every core online
)


def process_cpus() -> set[int]:
    """The cores this process may use: its cpuset (a container's), else
    every core online. Not the calling thread's affinity: once OpenMP has
    bound the engine thread (its team's first thread), that names the
    team's cores only. A process confined by ``taskset`` alone is not seen
    as confined: list its cores in ``maru_copy_cpus`` there."""
    for path in _CPUSET_FILES:
        try:
            with open(path) as f:
                return parse_cpu_list(f.read().strip())
        except (OSError, ValueError):
            continue
    return set(os.sched_getaffinity(0))


def parse_setting(setting: str) -> str | set[int]:
    """``maru_copy_cpus`` read: ``"auto"``, ``"none"`` or the cores it lists;
    ``CopyCpusError`` (saying what to write) for anything else."""
    value = setting.strip().lower()
    if value in ("auto", "none"):
        return value
    try:
        return parse_cpu_list(value)
    except ValueError as exc:
        raise CopyCpusError(
            f"maru_copy_cpus={setting!r}: {exc}; use \"auto\", \"none\" or cores like \"3\" or \"2,6-7\""
        ) from None


def resolve_copy_cpus(setting: str, environ: Mapping[str, str] | None = None,
                      allowed: set[int] | None = None) -> frozenset[int] | None:
    """The cores for the copy threads (None: leave them unpinned).

    Raises ``CopyCpusError`` for a list that is malformed or names no core
    this process may run on."""
    value = parse_setting(setting)
    if value == "none":
        return None
    environ = os.environ if environ is None else environ
    allowed = process_cpus() if allowed is None else allowed
    if isinstance(value, str):  # "auto", the one other word
        team = openmp_cpus(environ)
        free = allowed - team if team is not None else set()
        return frozenset(free) if free else None
    usable = value & allowed
    if not usable:
        raise CopyCpusError(
            f"maru_copy_cpus={setting!r} names none of the cores this process may use "
            f"({_format(allowed)}); pick cores from those, or \"auto\""
        )
    return frozenset(usable)


def pin_this_thread(cpus: frozenset[int] | None) -> None:
    """Bind the calling thread (not the process: Linux applies
    ``sched_setaffinity(0)`` to the caller only) to ``cpus``; where the
    kernel refuses (a cpuset changed since), it stays where it was."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("copy thread not pinned to cores %s (%s); it shares the forward's cores",
                       _format(set(cpus)), exc)


PRIORITIES = ("normal", "idle")


def check_priority(priority: str) -> None:
    """Raise ``CopyCpusError`` unless ``priority`` is one of ``PRIORITIES``."""
    if priority not in PRIORITIES:
        raise CopyCpusError(f"maru_copy_priority must be one of {', '.join(PRIORITIES)}, "
                            f"got {priority!r}")


def idle_this_thread() -> None:
    """Let the calling thread run only on a core nothing else wants
    (``SCHED_IDLE``; the caller only, as with the affinity above). Sharing
    cores with the forward, a copy thread that takes a core from one of the
    forward's OpenMP threads stalls the whole team at its next barrier; at
    idle priority it runs in the gaps the forward leaves (its Python between
    kernels, a passive OpenMP team waiting) and, when the forward waits for
    the layer it copies, on the core that wait frees."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:
        logger.warning("copy thread left at normal priority (%s)", exc)


def _format(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
